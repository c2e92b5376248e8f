"""The streaming runtime: jobs, tasks, network, checkpoints and recovery, whatever runs them."""
