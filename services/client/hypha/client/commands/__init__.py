"""The ``hypha`` subcommands, one module per group: jobs, workers, the local cluster."""
