"""pip metadata for the tensegrity_ros Python package.

`make setup` installs this in editable mode into .venv (console script
`tensegrity` + one script per ROS node). On a ROS machine the package is built
by colcon through CMakeLists.txt (ament_cmake); there the node launchers in
scripts/ are installed to lib/tensegrity_ros for `ros2 run`.
Dependencies are pinned in requirements/lock.txt (pip) or declared in
package.xml (rosdep), not here.
"""
from setuptools import find_packages, setup

PACKAGE = "tensegrity_ros"
NODES = ("dynamixel_driver", "mocap_ingest", "online_identifier", "state_predictor", "sim_robot", "plate_controller",
         "visualizer")

setup(
    name=PACKAGE,
    version="0.1.0",
    description="Tensegrity robot digital twin with ROS 2 interfaces",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=[PACKAGE, PACKAGE + ".*"]),
    package_data={PACKAGE + ".engine": ["native_step.c"]},      # built on first use (engine/native.py)
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + PACKAGE]),
        ("share/" + PACKAGE, ["package.xml"]),
    ],
    install_requires=[],
    zip_safe=False,
    entry_points={
        "console_scripts": ["tensegrity = tensegrity_ros.cli:main"]
        + [f"{node} = {PACKAGE}.nodes.{node}:main" for node in NODES],
    },
)
