"""A model split by layers over several hosts (torch.distributed): the plan of who holds what."""
