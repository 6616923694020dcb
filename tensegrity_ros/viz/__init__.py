"""Visualisation without rclpy: :mod:`.markers` (structure + state + parameters -> plain marker descriptions, what
the ``visualizer`` node publishes on /tensegrity/markers) and :mod:`.render` (the same markers drawn with
matplotlib: docs/img/markers.png). See docs/viz.md."""
from .markers import (BAR_COLOR, GHOST_COLOR, SLACK_COLOR, TENSION_COLORS, MarkerScene, MarkerSpec, MarkerStyle,
                      cylinder_pose, tension_color)

__all__ = ["BAR_COLOR", "GHOST_COLOR", "SLACK_COLOR", "TENSION_COLORS", "MarkerScene", "MarkerSpec", "MarkerStyle",
           "cylinder_pose", "tension_color"]
