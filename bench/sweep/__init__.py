"""Sweep runner: YAML grids → RunConfigs → launchers → results store."""
