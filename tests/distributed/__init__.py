"""torch.distributed with real processes: ranks on the gloo backend over loopback."""
