"""Running llama.cpp servers: one owner task per process, the runtimes behind one seam, exit classification."""
