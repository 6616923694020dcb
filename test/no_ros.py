"""One import hook that refuses ROS, for tests that run code in a subprocess as on a machine without ROS (a lent
GPU machine has none): rclpy and rpyutils, every ``rosidl*``, ``rcl_*`` and ``rmw*`` package, every message,
service and interface package (``*_msgs``, ``*_srvs``, ``*_interfaces``) and this package's generated messages.

``HOOK`` is Python source to put at the top of such a subprocess's code; it defines ``is_ros(name)`` and installs
the refusal (an ImportError that says "no ROS here").
"""
import textwrap

HOOK = textwrap.dedent("""
    import importlib, importlib.abc, json, sys

    def is_ros(name):
        top = name.split(".")[0]
        return (top in ("rclpy", "rpyutils") or top.startswith(("rosidl", "rcl_", "rmw"))
                or top.endswith(("_msgs", "_srvs", "_interfaces"))
                or name.startswith(("tensegrity_ros.msg", "tensegrity_ros.srv")))

    class NoRos(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if is_ros(name):
                raise ImportError("no ROS here: " + name)

    sys.meta_path.insert(0, NoRos())
""")
