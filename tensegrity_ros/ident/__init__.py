"""System identification (functional core, no ROS): stage 1 regression, stage 2 refinement, uncertainty."""
