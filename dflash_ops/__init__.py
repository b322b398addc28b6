"""dflash-ops: run DFlash drafter training in Proxmox LXC containers over SSH."""

__version__ = "0.1.0"
