"""Files the launcher and the ranks write safely: private folders that name their maker
(owned_folders), signed files (signed), and output files that never end the job (outputs)."""
