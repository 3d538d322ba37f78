"""hvdrun's elastic mode, by concern as Horovod's runner/elastic/: the hosts and their layout
(discovery), how each life ended and which hosts are left out (registration), the notice port
that tells rank 0 of host changes and hears of its commits (notices), and the loop that starts
a new life of the job after each change (driver)."""
