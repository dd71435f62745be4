"""Configuration: one typed section per component, the presets, and how the command line picks a run's config."""
