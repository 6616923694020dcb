"""Plots and text summaries shared by `tensegrity simulate`, `tensegrity identify` and the demo.

Matplotlib runs headless (Agg); every function writes a PNG and returns its path.
"""
from .figures import (ROW_COLUMNS, moving_nodes, parameter_rows, parameter_table, plate_motion, plot_convergence,
                      plot_node_motion, plot_plate_motion, plot_residuals, rows_csv, rows_markdown, rows_text)

__all__ = ["plate_motion", "plot_convergence", "plot_plate_motion", "plot_node_motion", "moving_nodes",
           "plot_residuals", "parameter_table",
           "parameter_rows", "rows_csv", "rows_markdown", "rows_text", "ROW_COLUMNS"]
