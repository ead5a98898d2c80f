"""Figures and reports made from results (matplotlib, Agg backend; nothing is shown on screen)."""
