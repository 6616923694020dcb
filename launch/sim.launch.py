"""The same graph against the simulated robot: sim_robot (MuJoCo twin of the TRUE robot + an emulated
Dynamixel bus on a pty) + dynamixel_driver (bus emulated: it talks to that pty through the real SDK) +
mocap_ingest + online_identifier + state_predictor.

    ros2 launch tensegrity_ros sim.launch.py record:=true

sim_robot perturbs the nominal model by perturb_fraction (config/nodes/sim_robot.yaml) to make the true
robot, unless true_model_file is given. The driver runs with bus=real on the pty link that sim_robot
creates (link_path in config/nodes/sim_robot.yaml = port in config/nodes/dynamixel_driver_sim.yaml). The driver is a
lifecycle node (managed: true), configured and then activated by this launch file as on the real robot
(manipulator.launch.py; driver_autostart:=false leaves that to `ros2 lifecycle set /dynamixel_driver ...`).

No cross-talk with a real robot: every process runs on ROS_DOMAIN_ID=domain_id (default 42, or the
ROS_DOMAIN_ID already set) with ROS_AUTOMATIC_DISCOVERY_RANGE=discovery_range (default LOCALHOST, or the
value already set), e.g. `domain_id:=7 discovery_range:=SUBNET` to watch it from another machine.
"""
import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription, TimerAction
from launch.conditions import IfCondition
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode, Node
from launch_ros.substitutions import FindPackageShare

from tensegrity_ros.isolation import launch_actions
from tensegrity_ros.lifecycle_launch import start_managed

PACKAGE = "tensegrity_ros"


def _share(*parts):
    return PathJoinSubstitution([FindPackageShare(PACKAGE), *parts])


def _config(name):
    return _share("config", "nodes", name)


def _isolation():
    """Launch arguments and actions that keep this simulated graph on its own domain, localhost only
    (:func:`tensegrity_ros.isolation.launch_actions`)."""
    return launch_actions(os.environ)


def generate_launch_description():
    model_file = LaunchConfiguration("model_file")
    reference_file = LaunchConfiguration("reference_file")
    arguments = [
        DeclareLaunchArgument("model_file", default_value=_share("config", "models", "stacked_manipulator.yaml")),
        DeclareLaunchArgument("true_model_file", default_value="",
                              description="structure YAML of the simulated (true) robot; empty = perturbed nominal"),
        DeclareLaunchArgument("reference_file", default_value=_share("config", "references", "seed_sinusoids.yaml")),
        DeclareLaunchArgument("record", default_value="false"),
        DeclareLaunchArgument("bag_path", default_value="sim_run"),
        DeclareLaunchArgument("controller", default_value="false",
                              description="also start plate_controller (MPC of the top plate, docs/control.md); "
                                          "its plan on /tensegrity/motor_plan is followed by the driver through its "
                                          "safety clamps; send a target on /tensegrity/plate_target"),
        DeclareLaunchArgument("driver_autostart", default_value="true",
                              description="configure and activate the driver at launch; false: "
                                          "ros2 lifecycle set /dynamixel_driver configure, then activate"),
    ]
    sim = Node(package=PACKAGE, executable="sim_robot", name="sim_robot", output="screen",
               parameters=[_config("sim_robot.yaml"),
                           {"model_file": model_file, "true_model_file": LaunchConfiguration("true_model_file")}])
    driver = LifecycleNode(package=PACKAGE, executable="dynamixel_driver", name="dynamixel_driver", namespace="",
                           output="screen",
                           parameters=[_config("dynamixel_driver.yaml"), _config("dynamixel_driver_sim.yaml"),
                                       {"model_file": model_file, "reference_file": reference_file, "managed": True}])
    graph = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(_share("launch", "graph.launch.py")),
        launch_arguments={"model_file": model_file, "reference_file": reference_file,
                          "mocap_topic": "/mocap/markers", "use_sim_time": "false",
                          "record": LaunchConfiguration("record"), "bag_path": LaunchConfiguration("bag_path")}.items())
    controller = Node(package=PACKAGE, executable="plate_controller", name="plate_controller", output="screen",
                      condition=IfCondition(LaunchConfiguration("controller")),
                      parameters=[_config("plate_controller.yaml"), {"model_file": model_file}])
    # RViz markers on /tensegrity/markers (docs/viz.md: rviz2 -d config/tensegrity.rviz)
    visualizer = Node(package=PACKAGE, executable="visualizer", name="visualizer", output="screen",
                      parameters=[_config("visualizer.yaml"), {"model_file": model_file}])
    # the driver opens the pty that sim_robot links: give sim_robot a head start
    driver_start = [driver, *start_managed(driver, LaunchConfiguration("driver_autostart"))]
    return LaunchDescription(_isolation() + arguments + [sim, TimerAction(period=3.0, actions=driver_start), graph,
                                                         controller, visualizer])
