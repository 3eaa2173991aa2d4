"""`kvpush simulate`: a discrete-event simulator of xPyD clusters (see docs/SIMULATOR.md).

SimPy and matplotlib are imported only where a simulation runs or a plot is drawn, so
`kvpush --help` stays light.
"""
