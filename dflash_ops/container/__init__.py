"""What the operator does in a container beside the run protocol: a shell or one command with the run
environment (shell.py), the target staged back into paths.model (stage.py), and a real target shipped
in a pip package installed and converted by deploy (real_target.py)."""
