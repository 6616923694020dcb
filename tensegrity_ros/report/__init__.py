"""Plots and text summaries shared by `tensegrity simulate`, `tensegrity identify` and the demo.

Matplotlib runs headless (Agg); every function writes a PNG and returns its path.
"""
from .figures import (plate_motion, plot_convergence, plot_plate_motion, plot_residuals, parameter_table)

__all__ = ["plate_motion", "plot_convergence", "plot_plate_motion", "plot_residuals", "parameter_table"]
