"""CURVE keys of the control plane: the certificate layout `prefetchd keys DIR`
makes, loading keys, and the server side of CURVE (a ZAP authenticator that
admits only the public keys in DIR/authorized_clients)."""
import logging
import os
import shutil

import zmq
import zmq.auth

from ..errors import ConfigError

SERVER_SECRET = "server.key_secret"
SERVER_PUBLIC = "server.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED_DIR = "authorized_clients"
ZAP_DOMAIN = "prefetchd"


def load_key(value, what):
    """A z85 key from bytes/str, or the `what` ("public"/"secret") half of a certificate file."""
    if isinstance(value, str) and os.path.exists(value):
        public, secret = zmq.auth.load_certificate(value)
        return secret if what == "secret" and secret else public
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or len(value) != 40:
        raise ConfigError(f"{what} key: expected a 40-character z85 key or a certificate path")
    return value


def client_curve(server_public_key, client_keys):
    """(server public, client public, client secret) for a Client; an ephemeral
    client pair when `client_keys` is None (an authorizing server refuses it)."""
    server_key = load_key(server_public_key, "public")
    if client_keys is None:
        public, secret = zmq.curve_keypair()
    elif isinstance(client_keys, (tuple, list)):
        public, secret = (load_key(k, w) for k, w in zip(client_keys, ("public", "secret")))
    else:
        public, secret = zmq.auth.load_certificate(client_keys)
        if secret is None:
            raise ConfigError(f"client_keys: {client_keys} holds no secret key")
    return server_key, public, secret


def check_server_keys(directory):
    if not os.path.exists(os.path.join(directory, SERVER_SECRET)):
        raise ConfigError(f"curve_keys_dir: {directory} has no {SERVER_SECRET} "
                          f"(create it with `prefetchd keys {directory}`)")


def start_authenticator(ctx, directory):
    """(authenticator, (public, secret)) of a CURVE server using `directory`."""
    from zmq.auth.thread import ThreadAuthenticator
    public, secret = zmq.auth.load_certificate(os.path.join(directory, SERVER_SECRET))
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("prefetchd.control.auth"))
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=os.path.join(directory, AUTHORIZED_DIR))
    return auth, (public, secret)


def make_curve_server(sock, curve):
    sock.curve_publickey, sock.curve_secretkey = curve
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    # Refuse connections if the authenticator is not there (libzmq would let them in).
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def create_keys(directory, clients=("client",)):
    """Server and client CURVE certificates in `directory` (0700; secrets 0600).

    Layout: server.key / server.key_secret, <client>.key / <client>.key_secret,
    and authorized_clients/<client>.key holding the public keys the server accepts.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    authorized = os.path.join(directory, AUTHORIZED_DIR)
    os.makedirs(authorized, mode=0o700, exist_ok=True)
    old = os.umask(0o077)
    try:
        made = []
        if not os.path.exists(os.path.join(directory, SERVER_SECRET)):
            made += zmq.auth.create_certificates(directory, "server")
        for client in clients:
            if not os.path.exists(os.path.join(directory, f"{client}.key_secret")):
                made += zmq.auth.create_certificates(directory, client)
            shutil.copyfile(os.path.join(directory, f"{client}.key"),
                            os.path.join(authorized, f"{client}.key"))
    finally:
        os.umask(old)
    for path in made:
        if path.endswith("_secret"):
            os.chmod(path, 0o600)
    return directory
