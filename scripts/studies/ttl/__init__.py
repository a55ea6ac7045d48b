"""The time-to-loss study (issue 34) in sections: settings, launch (the runs and rows), report."""
