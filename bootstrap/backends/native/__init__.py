"""The native backend: the stages over ``bootstrap.engine``, its checks, placement, default headroom and CUDA graphs."""
