# tensegrity_ros developer Makefile -- see docs/setup.md.
#
#   make setup   create .venv, install pinned deps (torch first), build the
#                custom ROS interfaces (msg/, srv/) with CMake into
#                build/ros/install and make them importable from .venv (plus
#                tf2_msgs/TFMessage where no tf2_msgs is installed: step 5)
#   make test    setup + pytest
#   make demo    setup + `tensegrity demo` (DEMO_ARGS are passed on: make demo DEMO_ARGS=--controller)
#   make bench   setup + bench/run_all.py
#   make lock    re-pin requirements/lock.txt from the current .venv
#   make clean   remove build outputs (keeps .venv);  make distclean: also .venv
#
# Every step is guarded by a stamp file named after a hash of its inputs, so a
# repeated `make setup` with nothing to do takes well under a second.
#
# Knobs (make VAR=value, environment, or an untracked local.mk):
#   PYTHON                     interpreter for the venv (must be 3.11: the ROS wheels are cp311)
#   VENV                       venv directory (.venv)
#   VENV_SYSTEM_SITE_PACKAGES  1 = venv sees the system site-packages (e.g. an
#                              existing CUDA torch); implies TORCH_SPEC=skip
#   TORCH_SPEC                 pip spec for torch, installed before everything
#                              else (default torch==2.13.0+cpu; with the default an
#                              installed 2.13.0 of another build, e.g. +cu128, is
#                              kept); `skip` = leave torch alone
#   TORCH_PIP_ARGS             extra pip args for torch only, e.g.
#                              --index-url https://download.pytorch.org/whl/cpu
#   TORCH_CONSTRAINTS          constraints applied to the torch install (-c requirements/lock.txt)
#   PIP_ARGS                   extra args for every pip call
#   JOBS                       parallel compile jobs (nproc)

# Optional, untracked per-machine overrides (e.g. `TORCH_SPEC = skip`).
-include local.mk

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := setup
.DELETE_ON_ERROR:

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
PYVER := 3.11
VENV ?= .venv
VENV_SYSTEM_SITE_PACKAGES ?= 0
ifeq ($(VENV_SYSTEM_SITE_PACKAGES),1)
TORCH_SPEC ?= skip
else
TORCH_SPEC ?= torch==2.13.0+cpu
endif
TORCH_PIP_ARGS ?=
TORCH_CONSTRAINTS ?= -c requirements/lock.txt
PIP_ARGS ?=
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
ROS_BUILD ?= build/ros

LOCK := requirements/lock.txt
VENV_ABS := $(abspath $(VENV))
VPY := $(VENV_ABS)/bin/python
PIP := $(VPY) -m pip $(PIP_ARGS)
STAMPS := $(VENV_ABS)/.stamps
VENV_SITE := $(VENV_ABS)/lib/python$(PYVER)/site-packages
ROS_BUILD_ABS := $(abspath $(ROS_BUILD))
ROS_PREFIX := $(ROS_BUILD_ABS)/install
ROS_SITE := $(ROS_PREFIX)/lib/python$(PYVER)/site-packages
PTH := $(VENV_SITE)/tensegrity_ros_interfaces.pth

# --- content keys (hashes of each step's inputs) ---------------------------
key_files = $(shell for f in $(sort $(wildcard $(1))); do echo "== $$f"; cat "$$f"; done | sha256sum | cut -c1-16)
DEPS_KEY := $(shell { cat $(LOCK) tools/fix_ros_wheel_paths.py; \
  echo '$(TORCH_SPEC)|$(TORCH_PIP_ARGS)|$(TORCH_CONSTRAINTS)|$(VENV_SYSTEM_SITE_PACKAGES)'; } | sha256sum | cut -c1-16)
MSGS_KEY := $(shell echo '$(DEPS_KEY)|$(ROS_PREFIX)|$(call key_files,msg/*.msg srv/*.srv CMakeLists.txt package.xml Makefile)' | sha256sum | cut -c1-16)
EDIT_KEY := $(shell echo '$(DEPS_KEY)|$(call key_files,setup.py setup.cfg Makefile)' | sha256sum | cut -c1-16)
TF2_KEY := $(shell echo '$(DEPS_KEY)|$(ROS_PREFIX)|$(call key_files,Makefile)' | sha256sum | cut -c1-16)

DEPS_STAMP := $(STAMPS)/deps-$(DEPS_KEY)
MSGS_STAMP := $(STAMPS)/msgs-$(MSGS_KEY)
EDIT_STAMP := $(STAMPS)/editable-$(EDIT_KEY)
TF2_STAMP := $(STAMPS)/tf2msgs-$(TF2_KEY)

# Re-run a step if its outputs vanished even though its stamp is still there.
MSGS_FORCE := $(if $(and $(wildcard $(ROS_SITE)/tensegrity_ros/msg/__init__.py),$(wildcard $(PTH))),,FORCE)
EDIT_FORCE := $(if $(wildcard $(VENV_ABS)/bin/tensegrity),,FORCE)
TF2_FORCE := $(if $(wildcard $(ROS_SITE)/tf2_msgs/msg/__init__.py $(VENV_SITE)/tf2_msgs/msg/__init__.py),,FORCE)

# Environment for the CMake build: only the venv's ROS (ignore a sourced ROS).
ROS_BUILD_ENV := env -u COLCON_PREFIX_PATH -u ROS_DISTRO \
  PATH="$(VENV_ABS)/bin:$$PATH" \
  AMENT_PREFIX_PATH="$(VENV_ABS)" CMAKE_PREFIX_PATH="$(VENV_ABS)" \
  PYTHONPATH= _ROS_WHEELS_BOOTSTRAP_COMPLETE=

.PHONY: setup test demo bench lock clean distclean FORCE
FORCE:

setup: $(DEPS_STAMP) $(EDIT_STAMP) $(MSGS_STAMP) $(TF2_STAMP)

# --- 1. the virtual environment --------------------------------------------
$(VPY):
	@echo ">>> creating $(VENV) with $(PYTHON)"
	@"$(PYTHON)" -c 'import sys; v=sys.version_info[:2]; sys.exit(0 if v==(3,11) else "error: Python 3.11 is required (ROS 2 Jazzy PyPI wheels are cp311); got %d.%d -- run: make setup PYTHON=/path/to/python3.11" % v)'
	"$(PYTHON)" -m venv $(if $(filter 1,$(VENV_SYSTEM_SITE_PACKAGES)),--system-site-packages) "$(VENV_ABS)"

# --- 2. pinned Python dependencies: torch FIRST, then the lock file ------------
$(DEPS_STAMP): | $(VPY)
	@"$(VPY)" -c 'import sys; v=sys.version_info[:2]; sys.exit(0 if v==(3,11) else "error: $(VENV) uses Python %d.%d, 3.11 is required; remove it (make distclean)" % v)'
	@if [ "$(VENV_SYSTEM_SITE_PACKAGES)" = 1 ] && ! grep -qi '^include-system-site-packages *= *true' "$(VENV_ABS)/pyvenv.cfg"; then \
	  echo "error: VENV_SYSTEM_SITE_PACKAGES=1 but $(VENV) was created without it; run 'make distclean' first" >&2; exit 1; fi
ifneq ($(TORCH_SPEC),skip)
	@have=$$("$(VPY)" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true); \
	want=$$(sed -n 's/^torch==\([^+;, ]*\).*/\1/p' <<< '$(TORCH_SPEC)'); \
	if [ "$(origin TORCH_SPEC)" = file ] && [ -n "$$want" ] && [ "$${have%%+*}" = "$$want" ] && [ "$$have" != "$(patsubst torch==%,%,$(TORCH_SPEC))" ]; then \
	  echo ">>> keeping installed torch $$have (same release as $(TORCH_SPEC); TORCH_SPEC=skip silences this)"; \
	else \
	  echo ">>> installing $(TORCH_SPEC) first (before anything that could pull torch)"; \
	  set -x; $(PIP) install $(TORCH_PIP_ARGS) $(TORCH_CONSTRAINTS) '$(TORCH_SPEC)'; \
	fi
else
	@echo ">>> TORCH_SPEC=skip: leaving torch alone (visible: $$("$(VPY)" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo none))"
endif
	@echo ">>> installing pinned dependencies from $(LOCK)"
	$(PIP) install -r $(LOCK)
	"$(VPY)" tools/fix_ros_wheel_paths.py
	@mkdir -p "$(STAMPS)" && rm -f "$(STAMPS)"/deps-* && touch "$@"

# --- 3. the tensegrity_ros source package (editable) + console scripts ------
$(EDIT_STAMP): $(EDIT_FORCE) | $(DEPS_STAMP)
	@echo ">>> installing tensegrity_ros (editable)"
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@mkdir -p "$(STAMPS)" && rm -f "$(STAMPS)"/editable-* && touch "$@"

# --- 4. custom interfaces: CMake build into $(ROS_PREFIX) ---------------------
# The .pth puts (1) the repo root and (2) the generated site-packages on
# sys.path. (1) makes the source package tensegrity_ros/ a regular package found
# by the normal path search, ahead of setuptools' editable finder; (2) holds
# tensegrity_ros/{msg,srv} + typesupport modules as a namespace portion (no
# __init__.py), which tensegrity_ros/__init__.py merges via pkgutil.extend_path.
# The typesupport .so files find their libraries through RUNPATH; see CMakeLists.txt.
$(MSGS_STAMP): $(MSGS_FORCE) | $(DEPS_STAMP) $(EDIT_STAMP)
	@echo ">>> building ROS interfaces (msg/, srv/) into $(ROS_PREFIX)"
	$(ROS_BUILD_ENV) "$(VENV_ABS)/bin/cmake" -S . -B "$(ROS_BUILD_ABS)/build" -G Ninja \
	  -DCMAKE_MAKE_PROGRAM="$(VENV_ABS)/bin/ninja" \
	  -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_INSTALL_PREFIX="$(ROS_PREFIX)" \
	  -DCMAKE_PREFIX_PATH="$(VENV_ABS)" \
	  "-DCMAKE_INSTALL_RPATH=$(ROS_PREFIX)/lib;$(VENV_ABS)/lib" \
	  -DPython3_EXECUTABLE="$(VPY)" \
	  -DPYTHON_INSTALL_DIR=lib/python$(PYVER)/site-packages \
	  -DTENSEGRITY_INSTALL_PYTHON_PACKAGE=OFF \
	  -DBUILD_TESTING=OFF --log-level=WARNING
	$(ROS_BUILD_ENV) "$(VENV_ABS)/bin/cmake" --build "$(ROS_BUILD_ABS)/build" -j $(JOBS)
	$(ROS_BUILD_ENV) "$(VENV_ABS)/bin/cmake" --install "$(ROS_BUILD_ABS)/build" > /dev/null
	@printf '%s\n' "$(CURDIR)" "$(ROS_SITE)" > "$(PTH)"
	@cd / && "$(VPY)" -c 'import tensegrity_ros as t; from tensegrity_ros.msg import NodeStates, IdentifiedParameters, PredictedStates; from tensegrity_ros.srv import SaveParameters, LoadParameters, GetLinearization, SetCommandSource; assert hasattr(t, "__version__"), "tensegrity_ros resolved to %s, not the source package" % list(t.__path__); print(">>> tensegrity_ros", t.__version__, "with interfaces from", list(t.__path__)[-1])'
	@mkdir -p "$(STAMPS)" && rm -f "$(STAMPS)"/msgs-* && touch "$@"

# --- 5. tf2_msgs (TFMessage only) where no tf2_msgs is installed ----------------
# No ros-tf2-msgs wheel exists, so /tf and /tf_static (mocap_ingest) need the message built here: a
# one-message interface package is generated under $(ROS_BUILD)/tf2_msgs/src and built with rosidl into the
# same prefix as msg/ (its Python package lands in $(ROS_SITE), on the .pth path). Its definition is the
# upstream one, so its type hash matches a ROS machine's tf2_msgs/msg/TFMessage. Skipped when the venv
# already imports a tf2_msgs of its own (a wheel, or system site-packages); colcon on a ROS machine never
# runs this and uses the system's tf2_msgs.
TF2_SRC := $(ROS_BUILD_ABS)/tf2_msgs/src

define TF2_MSGS_PACKAGE_XML
<?xml version="1.0"?>
<package format="3">
  <name>tf2_msgs</name>
  <version>0.36.0</version>
  <description>tf2_msgs/TFMessage only: generated by tensegrity_ros's Makefile where no tf2_msgs is installed</description>
  <maintainer email="maintainer@example.com">tensegrity_ros maintainers</maintainer>
  <license>BSD-3-Clause</license>
  <buildtool_depend>ament_cmake</buildtool_depend>
  <buildtool_depend>rosidl_default_generators</buildtool_depend>
  <depend>geometry_msgs</depend>
  <exec_depend>rosidl_default_runtime</exec_depend>
  <member_of_group>rosidl_interface_packages</member_of_group>
  <export><build_type>ament_cmake</build_type></export>
</package>
endef

define TF2_MSGS_CMAKELISTS
# Generated by tensegrity_ros's Makefile (step 5): tf2_msgs/TFMessage only.
cmake_minimum_required(VERSION 3.16)
project(tf2_msgs)
if(NOT CMAKE_CXX_STANDARD)
  set(CMAKE_CXX_STANDARD 17)
endif()
set(CMAKE_INSTALL_RPATH_USE_LINK_PATH TRUE)
find_package(ament_cmake REQUIRED)
find_package(rosidl_default_generators REQUIRED)
find_package(geometry_msgs REQUIRED)
rosidl_generate_interfaces($${PROJECT_NAME} "msg/TFMessage.msg" DEPENDENCIES geometry_msgs)
# As in tensegrity_ros's CMakeLists.txt: the Python extension links the typesupport libraries directly, so
# they load through its RUNPATH, without LD_LIBRARY_PATH.
set(_ts "$${PROJECT_NAME}_s__rosidl_typesupport_c")
if(TARGET $${_ts} AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
  target_link_options($${_ts} PRIVATE "LINKER:--no-as-needed")
  foreach(_impl rosidl_typesupport_fastrtps_c rosidl_typesupport_introspection_c)
    if(TARGET $${PROJECT_NAME}__$${_impl})
      target_link_libraries($${_ts} PRIVATE $${PROJECT_NAME}__$${_impl})
    endif()
  endforeach()
endif()
ament_export_dependencies(rosidl_default_runtime)
ament_package()
endef
export TF2_MSGS_PACKAGE_XML TF2_MSGS_CMAKELISTS

$(TF2_STAMP): $(TF2_FORCE) | $(DEPS_STAMP) $(MSGS_STAMP)
	@if (cd / && env -u PYTHONPATH "$(VPY)" -c 'import sys; sys.path[:] = [p for p in sys.path if p.rstrip("/") != "$(ROS_SITE)"]; import tf2_msgs.msg') 2>/dev/null; then \
	  echo ">>> tf2_msgs is installed: using it"; \
	else \
	  echo ">>> building tf2_msgs (TFMessage) into $(ROS_PREFIX): no tf2_msgs is installed"; \
	  rm -rf "$(TF2_SRC)" && mkdir -p "$(TF2_SRC)/msg"; \
	  printf '%s\n' "$$TF2_MSGS_PACKAGE_XML" > "$(TF2_SRC)/package.xml"; \
	  printf '%s\n' "$$TF2_MSGS_CMAKELISTS" > "$(TF2_SRC)/CMakeLists.txt"; \
	  printf '%s\n' "geometry_msgs/TransformStamped[] transforms" > "$(TF2_SRC)/msg/TFMessage.msg"; \
	  $(ROS_BUILD_ENV) "$(VENV_ABS)/bin/cmake" -S "$(TF2_SRC)" -B "$(ROS_BUILD_ABS)/tf2_msgs/build" -G Ninja \
	    -DCMAKE_MAKE_PROGRAM="$(VENV_ABS)/bin/ninja" -DCMAKE_BUILD_TYPE=Release \
	    -DCMAKE_INSTALL_PREFIX="$(ROS_PREFIX)" -DCMAKE_PREFIX_PATH="$(VENV_ABS)" \
	    "-DCMAKE_INSTALL_RPATH=$(ROS_PREFIX)/lib;$(VENV_ABS)/lib" -DPython3_EXECUTABLE="$(VPY)" \
	    -DPYTHON_INSTALL_DIR=lib/python$(PYVER)/site-packages -DBUILD_TESTING=OFF --log-level=WARNING; \
	  $(ROS_BUILD_ENV) "$(VENV_ABS)/bin/cmake" --build "$(ROS_BUILD_ABS)/tf2_msgs/build" -j $(JOBS); \
	  $(ROS_BUILD_ENV) "$(VENV_ABS)/bin/cmake" --install "$(ROS_BUILD_ABS)/tf2_msgs/build" > /dev/null; \
	  (cd / && "$(VPY)" -c 'import tf2_msgs; from tf2_msgs.msg import TFMessage; print(">>> tf2_msgs built:", list(tf2_msgs.__path__)[0])'); \
	fi
	@mkdir -p "$(STAMPS)" && rm -f "$(STAMPS)"/tf2msgs-* && touch "$@"

# --- everyday targets ----------------------------------------------------------
# A hang is a failure with a stack dump, never a silent wait: pytest-timeout ends a test that runs past
# TEST_TIMEOUT_S (thread method: every thread's stack, then exit 1); test/conftest.py fails the session if
# threads or child processes outlive it, and dumps the stacks if the interpreter does not exit within 60 s.
TEST_TIMEOUT_S ?= 600
test: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT_S) --timeout-method=thread --durations=15 test

DEMO_ARGS ?=
demo: setup
	$(VENV)/bin/tensegrity demo $(DEMO_ARGS)

bench: setup
	$(VENV)/bin/python bench/run_all.py

# Re-pin: write exactly what pip installed in the venv (minus torch, which is
# TORCH_SPEC's business, and this package itself).
lock: | $(VPY)
	"$(VPY)" tools/freeze_lock.py > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	@echo ">>> wrote $(LOCK) ($$(wc -l < $(LOCK)) pins)"

clean:
	rm -rf build/ install/ log/ ./*.egg-info .pytest_cache
	rm -f "$(PTH)" "$(STAMPS)"/msgs-*
	find . -path ./.venv -prune -o -path ./.git -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf "$(VENV_ABS)"
