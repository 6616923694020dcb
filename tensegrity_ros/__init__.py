"""tensegrity_ros: tensegrity robot digital twin (simulation, hardware, identification, ROS 2 nodes)."""

# The generated ROS interfaces (tensegrity_ros.msg / tensegrity_ros.srv and the
# typesupport extension modules) may live in a different directory named
# `tensegrity_ros` on sys.path (e.g. build/ros/install/.../site-packages after
# `make setup`); merge all such directories into this package. Harmless in a
# colcon install, where both live in the same directory.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
