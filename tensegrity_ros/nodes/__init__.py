"""ROS 2 nodes: thin rclpy shells over the functional core (the only place, with cli/bringup, that imports rclpy).

The data the shells share is ROS-free: the parameter specs (:mod:`.params`), every node's parameter table
(:mod:`.tables`) and the topic names (:mod:`.topic_names`) import no rclpy and no message package.
"""
