"""ROS 2 nodes: thin rclpy shells over the functional core (the only place, with cli/bringup, that imports rclpy)."""
