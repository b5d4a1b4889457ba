"""The store: the LMDB replica, its record layout and the near cache kept in the same file.
Shared by the sidecar and the application's LocalReader; imports nothing of the other sides."""
