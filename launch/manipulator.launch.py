"""The real stacked manipulator: dynamixel_driver on the U2D2 + mocap_ingest + online_identifier +
state_predictor (see docs/nodes.md for the step-by-step set-up).

    ros2 launch tensegrity_ros manipulator.launch.py mocap_topic:=/optitrack/markers record:=true

Arguments: bus_config (config/hardware/manipulator_bus.yaml), model_file, reference_file, mocap_topic,
record, bag_path (all but bus_config are passed on to graph.launch.py), controller (false): also start
plate_controller; the driver follows its /tensegrity/motor_plan through its safety clamps (limits, rate limit,
plan timeout: hold) once a target arrives on /tensegrity/plate_target (docs/control.md); driver_autostart (true).

The driver is a lifecycle node (managed: true): launch configures it (port opened, motors pinged and checked, torque
off) and, once it is inactive, activates it (torque on, holding, loop running), the first time only. With
driver_autostart:=false it waits: `ros2 lifecycle set /dynamixel_driver configure`, then `... activate`;
`... deactivate` turns torque off again (docs/nodes.md).
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription
from launch.conditions import IfCondition
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode, Node
from launch_ros.substitutions import FindPackageShare

from tensegrity_ros.lifecycle_launch import start_managed

PACKAGE = "tensegrity_ros"


def _share(*parts):
    return PathJoinSubstitution([FindPackageShare(PACKAGE), *parts])


def _config(name):
    return _share("config", "nodes", name)


def generate_launch_description():
    model_file = LaunchConfiguration("model_file")
    reference_file = LaunchConfiguration("reference_file")
    arguments = [
        DeclareLaunchArgument("bus_config", default_value=_share("config", "hardware", "manipulator_bus.yaml"),
                              description="Dynamixel bus YAML (port, baud, motors)"),
        DeclareLaunchArgument("model_file", default_value=_share("config", "models", "stacked_manipulator.yaml")),
        DeclareLaunchArgument("reference_file", default_value=_share("config", "references", "seed_sinusoids.yaml")),
        DeclareLaunchArgument("mocap_topic", default_value="/mocap/markers"),
        DeclareLaunchArgument("record", default_value="false"),
        DeclareLaunchArgument("bag_path", default_value="manipulator_run"),
        DeclareLaunchArgument("controller", default_value="false",
                              description="also start plate_controller (MPC of the top plate, docs/control.md)"),
        DeclareLaunchArgument("driver_autostart", default_value="true",
                              description="configure and activate the driver (torque on) at launch; false: "
                                          "ros2 lifecycle set /dynamixel_driver configure, then activate"),
    ]
    driver = LifecycleNode(package=PACKAGE, executable="dynamixel_driver", name="dynamixel_driver", namespace="",
                           output="screen",
                           parameters=[_config("dynamixel_driver.yaml"),
                                       {"bus_config": LaunchConfiguration("bus_config"), "model_file": model_file,
                                        "reference_file": reference_file, "managed": True}])
    graph = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(_share("launch", "graph.launch.py")),
        launch_arguments={"model_file": model_file, "reference_file": reference_file,
                          "mocap_topic": LaunchConfiguration("mocap_topic"), "use_sim_time": "false",
                          "record": LaunchConfiguration("record"), "bag_path": LaunchConfiguration("bag_path")}.items())
    controller = Node(package=PACKAGE, executable="plate_controller", name="plate_controller", output="screen",
                      condition=IfCondition(LaunchConfiguration("controller")),
                      parameters=[_config("plate_controller.yaml"), {"model_file": model_file}])
    # RViz markers on /tensegrity/markers (docs/viz.md: rviz2 -d config/tensegrity.rviz)
    visualizer = Node(package=PACKAGE, executable="visualizer", name="visualizer", output="screen",
                      parameters=[_config("visualizer.yaml"), {"model_file": model_file}])
    return LaunchDescription(arguments + [driver, *start_managed(driver, LaunchConfiguration("driver_autostart")),
                                          graph, controller, visualizer])
