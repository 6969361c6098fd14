"""Command-line scaffolding shared by every role's CLI."""
