"""Reference solutions of the exercises, one file per exercise, same names and signatures."""
