"""What the control plane asks of the box besides stages: its facts (GPUs, disk, packages), a run's report
files, and retention."""
