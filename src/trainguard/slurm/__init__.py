"""SLURM awareness: job information, the job's end time, requeue, sbatch script generation."""
