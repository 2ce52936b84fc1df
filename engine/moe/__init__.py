"""A MoE layer's experts: as the file stores them, routing, and the expert set run from host memory."""
