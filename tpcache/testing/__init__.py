"""Test support shipped with the package: random operation streams and a fake shell."""
