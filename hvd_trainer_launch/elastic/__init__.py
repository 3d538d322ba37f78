"""hvdrun's elastic mode: the driver loop that starts a new life of the job after each change,
and the notice port that tells rank 0 of host changes and hears of its commits."""
