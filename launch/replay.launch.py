"""Offline: mocap_ingest + online_identifier + state_predictor against `ros2 bag play` of a recording
(simulated time from the bag's /clock).

    ros2 launch tensegrity_ros replay.launch.py bag:=manipulator_run rate:=1.0

Only the raw inputs (/mocap/markers, /tensegrity/motor_states) are played, so the graph recomputes
node states, parameters and predictions. Same arguments as graph.launch.py plus bag and rate.

The played motor states, markers and /clock must not reach a real robot's graph: like sim.launch.py it runs
on domain_id (default 42, or the ROS_DOMAIN_ID already set) and discovery_range (default LOCALHOST, or the
ROS_AUTOMATIC_DISCOVERY_RANGE already set).
"""
import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.substitutions import FindPackageShare

from tensegrity_ros.isolation import launch_actions

PACKAGE = "tensegrity_ros"


def _share(*parts):
    return PathJoinSubstitution([FindPackageShare(PACKAGE), *parts])


def _isolation():
    """Launch arguments and actions that keep this simulated graph on its own domain, localhost only
    (:func:`tensegrity_ros.isolation.launch_actions`)."""
    return launch_actions(os.environ)


def generate_launch_description():
    arguments = [
        DeclareLaunchArgument("bag", description="rosbag2 folder to play (MCAP or sqlite3)"),
        DeclareLaunchArgument("rate", default_value="1.0", description="playback rate"),
        DeclareLaunchArgument("model_file", default_value=_share("config", "models", "stacked_manipulator.yaml")),
        DeclareLaunchArgument("reference_file", default_value=_share("config", "references", "seed_sinusoids.yaml")),
        DeclareLaunchArgument("mocap_topic", default_value="/mocap/markers"),
        DeclareLaunchArgument("record", default_value="false"),
        DeclareLaunchArgument("bag_path", default_value="replay_run"),
    ]
    play = ExecuteProcess(
        cmd=["ros2", "bag", "play", LaunchConfiguration("bag"), "--clock", "--rate", LaunchConfiguration("rate"),
             "--topics", LaunchConfiguration("mocap_topic"), "/tensegrity/motor_states"],
        output="screen")
    graph = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(_share("launch", "graph.launch.py")),
        launch_arguments={"model_file": LaunchConfiguration("model_file"),
                          "reference_file": LaunchConfiguration("reference_file"),
                          "mocap_topic": LaunchConfiguration("mocap_topic"), "use_sim_time": "true",
                          "record": LaunchConfiguration("record"), "bag_path": LaunchConfiguration("bag_path")}.items())
    return LaunchDescription(_isolation() + arguments + [play, graph])
