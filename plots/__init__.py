"""Loss-curve figures (numpy + matplotlib only), shared by the workers, the service and the CLI."""
