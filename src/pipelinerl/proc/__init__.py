"""Process plumbing every floor may use: worker pools, CPU threads, stop signals, free ports,
the download cache and import-path plugins."""
