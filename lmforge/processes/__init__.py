"""Running processes: a step's entry (`entry`) launched with one call (`launch`), supervised process
groups that stop when their owner goes (`launcher`, `supervise`), GPU reservations (`devices`), and
SLURM job scripts (`slurm`)."""
