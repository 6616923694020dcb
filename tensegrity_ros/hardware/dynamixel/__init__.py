"""Dynamixel Protocol 2.0: control tables (data), pure packet functions, the SDK-backed bus and a
pty emulator."""
