#!/bin/sh
# Entrypoint of the fusedlayer images (installed as /usr/local/bin/fusedlayer-entrypoint).
#
#   fusedlayer-entrypoint [fusedlayer_server flags...]
#
# The gRPC listen address comes from the environment variable FUSEDLAYER_ADDRESS (host:port, image
# default 0.0.0.0:50051), not from an --address flag, because the image's HEALTHCHECK runs in a
# separate process that sees only the container's environment: both read the same variable, so the
# health probe follows the port the server listens on. An --address flag is refused with a message
# (it would silently leave the HEALTHCHECK probing another port).
set -eu

die() {
  echo "fusedlayer-entrypoint: $*" >&2
  exit 64  # EX_USAGE
}

addr="${FUSEDLAYER_ADDRESS:-}"
port="${addr##*:}"
case "$port" in
  "" | *[!0-9]*) die "FUSEDLAYER_ADDRESS='$addr' is not host:port (e.g. 0.0.0.0:50051)" ;;
esac
[ "$port" != "$addr" ] || die "FUSEDLAYER_ADDRESS='$addr' is not host:port (e.g. 0.0.0.0:50051)"

for arg in "$@"; do
  case "$arg" in
    --address | --address=* | -address | -address=*)
      die "set the listen address with the environment variable FUSEDLAYER_ADDRESS (now '$addr'), not $arg: the image HEALTHCHECK probes 127.0.0.1 at the port of FUSEDLAYER_ADDRESS" ;;
  esac
done

# exec: the server is PID 1 and receives the SIGTERM of `docker stop` / the kubelet (drain).
exec fusedlayer_server --address="$addr" "$@"
