"""Every node's parameter table, one module per node named as the node's module (and executable):
``tensegrity_ros.nodes.tables.<node>.PARAMS``, a tuple of :class:`~tensegrity_ros.nodes.params.ParamSpec`.

ROS-free (no rclpy, no message packages), so the declared parameters (names, defaults, units, ranges, choices)
can be read without a ROS installation: by the launch-file test and by help or documentation tooling. The node
module declares the same table (its ``PARAMS`` is this object). Defaults the functional core owns (the marker
style, the labeller, ...) are read from the core, not copied.
"""
