"""Launch-file support for the managed (lifecycle) driver: one definition of the start-up sequence that
``launch/manipulator.launch.py`` and ``launch/sim.launch.py`` both use. Imports ``launch`` / ``launch_ros`` only
when called, so this module stays importable without them (they have no wheels; the launch files are tested
statically)."""
from __future__ import annotations


def start_managed(node, autostart):
    """Actions that configure the lifecycle ``node`` at launch and activate it once configure succeeded (the first
    time only: a later deactivate / cleanup is the operator's), both only if the launch condition ``autostart``
    (a substitution, e.g. ``LaunchConfiguration("driver_autostart")``) is true."""
    from launch.actions import EmitEvent, RegisterEventHandler
    from launch.conditions import IfCondition
    from launch.events import matches_action
    from launch_ros.event_handlers import OnStateTransition
    from launch_ros.events.lifecycle import ChangeState
    from lifecycle_msgs.msg import Transition

    def change(transition_id, **kwargs):
        return EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node), transition_id=transition_id),
                         **kwargs)

    when = IfCondition(autostart)
    return [RegisterEventHandler(OnStateTransition(target_lifecycle_node=node, start_state="configuring",
                                                   goal_state="inactive", handle_once=True,
                                                   entities=[change(Transition.TRANSITION_ACTIVATE)]), condition=when),
            change(Transition.TRANSITION_CONFIGURE, condition=when)]
