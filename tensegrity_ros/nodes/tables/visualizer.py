"""``visualizer``'s parameters (:mod:`tensegrity_ros.nodes.visualizer`): the marker style's defaults are
:class:`~tensegrity_ros.viz.markers.MarkerStyle`'s."""
from __future__ import annotations

from ...viz.markers import MarkerStyle
from ..params import ParamSpec, required_file

_S = MarkerStyle()

PARAMS = (
    ParamSpec("model_file", "", "structure YAML (bars, strings, nominal parameters)", check=required_file,
              read_only=True),
    ParamSpec("rate_hz", 10.0, "MarkerArray rate [Hz] (at most; nothing new, nothing sent)", range=(0.1, 60.0),
              read_only=True),
    ParamSpec("frame_id", "", "frame of the markers ('' = the node states' frame_id)", read_only=True),
    ParamSpec("tension_scale_n", _S.tension_scale_n, "tension at the red end of the colour scale [N] (0 = 1.5 x "
              "the largest tension at rest with the active parameters)", range=(0.0, 1e7)),
    ParamSpec("ghost_steps", _S.ghost_steps, "horizon steps drawn as ghosts (0 = no ghost)", range=(0, 50)),
    ParamSpec("ghost_alpha", _S.ghost_alpha, "opacity of the nearest ghost (the last: a quarter of it)",
              range=(0.0, 1.0)),
    ParamSpec("string_width_m", _S.string_width_m, "line width of the strings [m]", range=(1e-4, 0.1)),
    ParamSpec("prediction_timeout_s", 1.0, "no ghost when the latest prediction's horizon ended this long before "
              "the node states [s]", range=(0.0, 600.0)),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)
