"""The keys of a secure Flower deployment (``fedflat flower-keys``): a development certificate authority, the
SuperLink's TLS certificate, and one SuperNode key pair per partition, made with the ``cryptography`` package.

- ``ca.crt`` / ``ca.key``: the certificate authority (EC P-384, self-signed). ``ca.crt`` goes to the SuperLink
  (``--ssl-ca-certfile``), every SuperNode (``--root-certificates``) and the ``flwr`` CLI's connection
  (``root-certificates``); ``ca.key`` signs certificates and goes nowhere.
- ``server.crt`` / ``server.key``: the SuperLink's TLS certificate for the given hosts (127.0.0.1 and localhost by
  default), signed by the CA (``--ssl-certfile``, ``--ssl-keyfile``).
- ``node-P`` / ``node-P.pub``: partition ``P``'s SuperNode key pair (EC P-384, OpenSSH format, as Flower reads them):
  the private key stays on that node (``--auth-supernode-private-key``), the public key is registered with the
  SuperLink (``flwr supernode register node-P.pub``) and named in ``node-keys.txt``.
- ``node-keys.txt``: the roster, ``P <public key>`` per line: ``fedflat flower-app --keys DIR`` puts it in the app's
  run config (``node-keys``), and the server then gives partition ``P``'s clients only to the node holding its key.

These are development keys (a CA on the same disk as what it signs); a production deployment uses its own PKI.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedflat.core import ConfigError

ROSTER = "node-keys.txt"
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedflat development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: x509.Name, key, issuer: x509.Name, signer, days: int, ca: bool, hosts=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        names = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = (builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    return builder.sign(signer, hashes.SHA384())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Writes ``data`` to ``path`` (a private key readable by its owner only, from its first byte)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_keys(folder: str | Path, nodes: int, hosts: tuple[str, ...] = DEFAULT_HOSTS, days: int = 365,
              overwrite: bool = False) -> dict[str, Path]:
    """Writes a development CA, the SuperLink's certificate for ``hosts`` and ``nodes`` SuperNode key pairs to
    ``folder`` (see the module docstring); returns the files by role."""
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: a federation needs at least one SuperNode")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise ConfigError(f"{folder} exists and is not empty: choose another folder (or --force to replace its keys)")
    folder.mkdir(parents=True, exist_ok=True)
    curve = ec.SECP384R1()
    ca_key, server_key = ec.generate_private_key(curve), ec.generate_private_key(curve)
    ca_name = _name("fedflat development CA")
    ca = _certificate(ca_name, ca_key, ca_name, ca_key, days, ca=True)
    server = _certificate(_name(hosts[0]), server_key, ca_name, ca_key, days, ca=False, hosts=hosts)
    files = {"ca.crt": folder / "ca.crt", "ca.key": folder / "ca.key", "server.crt": folder / "server.crt",
             "server.key": folder / "server.key", "roster": folder / ROSTER}
    _write(files["ca.key"], _pem(ca_key), private=True)
    _write(files["ca.crt"], ca.public_bytes(serialization.Encoding.PEM))
    _write(files["server.key"], _pem(server_key), private=True)
    _write(files["server.crt"], server.public_bytes(serialization.Encoding.PEM))
    roster = []
    for p in range(nodes):
        key = ec.generate_private_key(curve)
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        files[f"node-{p}"], files[f"node-{p}.pub"] = folder / f"node-{p}", folder / f"node-{p}.pub"
        _write(files[f"node-{p}"], key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                     serialization.NoEncryption()), private=True)
        _write(files[f"node-{p}.pub"], public + f" fedflat-partition-{p}\n".encode())
        roster.append(f"{p} {public.decode()}")
    _write(files["roster"], ("# partition-id and the public key of the SuperNode that holds it (fedflat flower-keys)\n"
                             + "\n".join(roster) + "\n").encode())
    return files


def read_roster(text: str, where: str = "node-keys") -> dict[int, bytes]:
    """The roster ``P <OpenSSH public key>`` per line as partition -> the key as Flower's SuperLink holds it (PEM
    SubjectPublicKeyInfo); blank lines and ``#`` comments are skipped."""
    roster: dict[int, bytes] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            partition, key = line.split(None, 1)
            public = serialization.load_ssh_public_key(key.strip().encode())
            if not isinstance(public, ec.EllipticCurvePublicKey):
                raise ValueError("not an elliptic-curve key (Flower's SuperNode keys are)")
            pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            partition_id = int(partition)
        except ValueError as err:
            raise ConfigError(f"{where}, line {number}: not 'PARTITION-ID PUBLIC-KEY' ({err}): write it with "
                              "`fedflat flower-keys`") from None
        if partition_id in roster:
            raise ConfigError(f"{where}, line {number}: partition {partition_id} is listed twice")
        roster[partition_id] = pem
    return roster


def roster_of(folder: str | Path) -> str:
    """The roster text of a ``fedflat flower-keys`` folder."""
    path = Path(folder) / ROSTER
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: make the deployment's keys with `fedflat flower-keys {folder} "
                          "--nodes N` first")
    text = path.read_text()
    read_roster(text, str(path))
    return text
