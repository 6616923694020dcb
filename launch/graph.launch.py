"""The robot-independent part of the graph: mocap_ingest, online_identifier, state_predictor (and the
optional MCAP recorder). Included by manipulator.launch.py, sim.launch.py and replay.launch.py.

Arguments: model_file (the nominal structure), reference_file (the drive the predictor phase-locks to),
mocap_topic (the mocap driver's PoseArray topic, remapped onto /mocap/markers), use_sim_time,
record (true: `ros2 bag record -s mcap -a`), bag_path.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

PACKAGE = "tensegrity_ros"


def _share(*parts):
    return PathJoinSubstitution([FindPackageShare(PACKAGE), *parts])


def _config(name):
    """A node's ROS parameter file under config/nodes/."""
    return _share("config", "nodes", name)


def generate_launch_description():
    model_file = LaunchConfiguration("model_file")
    reference_file = LaunchConfiguration("reference_file")
    use_sim_time = LaunchConfiguration("use_sim_time")
    arguments = [
        DeclareLaunchArgument("model_file", default_value=_share("config", "models", "stacked_manipulator.yaml"),
                              description="nominal structure YAML"),
        DeclareLaunchArgument("reference_file",
                              default_value=_share("config", "references", "seed_sinusoids.yaml"),
                              description="reference the driver runs (the predictor phase-locks to it)"),
        DeclareLaunchArgument("mocap_topic", default_value="/mocap/markers",
                              description="PoseArray topic of the mocap driver (remapped onto /mocap/markers)"),
        DeclareLaunchArgument("use_sim_time", default_value="false", description="true when replaying a bag"),
        DeclareLaunchArgument("record", default_value="false", description="record all topics to MCAP"),
        DeclareLaunchArgument("bag_path", default_value="tensegrity_run", description="output folder of the recording"),
    ]
    nodes = [
        Node(package=PACKAGE, executable="mocap_ingest", name="mocap_ingest", output="screen",
             parameters=[_config("mocap_ingest.yaml"), {"model_file": model_file, "use_sim_time": use_sim_time}],
             remappings=[("/mocap/markers", LaunchConfiguration("mocap_topic"))]),
        Node(package=PACKAGE, executable="online_identifier", name="online_identifier", output="screen",
             parameters=[_config("online_identifier.yaml"), {"model_file": model_file, "use_sim_time": use_sim_time}]),
        Node(package=PACKAGE, executable="state_predictor", name="state_predictor", output="screen",
             parameters=[_config("state_predictor.yaml"),
                         {"model_file": model_file, "reference_file": reference_file, "use_sim_time": use_sim_time}]),
        ExecuteProcess(cmd=["ros2", "bag", "record", "-s", "mcap", "-a", "-o", LaunchConfiguration("bag_path")],
                       output="screen", condition=IfCondition(LaunchConfiguration("record"))),
    ]
    return LaunchDescription(arguments + nodes)
