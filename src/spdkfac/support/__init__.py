"""Small utilities every floor may use: option validators, atomic JSON files, optional
packages."""
