"""A run's life outside the model: start-up checks, config value rules, entry points'
errors, checkpoints (save, read, convert, the best kept), the run record, profiles,
the compile cache."""
