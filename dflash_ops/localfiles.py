"""Local files the tool reads on the operator's say-so (inventory, SSH key, known_hosts): read as data.

Each must be a regular file of bounded size: `/dev/zero` would be read forever and a FIFO would
block forever. A private key readable by group or others is refused as OpenSSH refuses it. The
inventory's YAML is loaded strictly: a duplicate key is an error (YAML's "last one wins" hides a
typo), and aliases are bounded so that an alias bomb is refused before anything walks it.
"""

from __future__ import annotations

import os
import stat

import yaml

from .errors import InventoryError

INVENTORY_MAX = 1 << 20
KEY_MAX = 64 << 10
KNOWN_HOSTS_MAX = 8 << 20
MAX_ALIASES = 100
MAX_EXPANDED_NODES = 100_000


def read_regular(path: str, limit: int, what: str) -> bytes:
    """The bytes of `path`, refused in one line unless it is a regular file of at most `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not wait
    except FileNotFoundError:
        raise
    except OSError as exc:  # permissions, a loop of symlinks
        raise InventoryError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    try:
        check_regular(os.fstat(fd), path, limit, what)
    except InventoryError:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InventoryError(f"{path}: the {what} is larger than {limit} bytes: refusing it")
    return data


def check_regular(st: os.stat_result, path: str, limit: int, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise InventoryError(f"{path}: the {what} is not a regular file (a device, FIFO or directory): "
                             f"give the path of a file")
    if st.st_size > limit:
        raise InventoryError(f"{path}: the {what} is {st.st_size} bytes, more than {limit}: refusing it")


def check_file(path: str, limit: int, what: str) -> None:
    """A file another library will open (paramiko): regular and bounded, checked without reading it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # the caller's own "not found" handling applies
    except OSError as exc:
        raise InventoryError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    check_regular(st, path, limit, what)


def check_private_key(path: str) -> None:
    """OpenSSH's rule: a private key of ours that group or others can read is not used."""
    check_file(path, KEY_MAX, "private key")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        raise InventoryError(f"{path}: UNPROTECTED PRIVATE KEY FILE: permissions "
                             f"{stat.S_IMODE(st.st_mode):04o} are too open (group or others can read it), "
                             f"and OpenSSH ignores such a key: run `chmod 600 {path}`")


# --- strict YAML ------------------------------------------------------------------------------------
class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and bounds aliases (count and expanded size)."""

    def __init__(self, stream, path: str = "<inventory>"):
        super().__init__(stream)
        self.path = path
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise InventoryError(f"{self.path}: line {mark.line + 1}: more than {MAX_ALIASES} "
                                     "YAML aliases: refusing it (an alias bomb?)")
        return super().compose_node(parent, index)

    def compose_document(self):
        node = super().compose_document()
        expanded_size(node, self.path)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise InventoryError(f"{self.path}: line {key_node.start_mark.line + 1}: duplicate key "
                                         f"{key!r} (first at line {seen[key]}): remove one of them")
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def expanded_size(root, path: str) -> int:
    """Nodes the document stands for once aliases are followed; refuse cycles and bombs."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise InventoryError(f"{path}: line {node.start_mark.line + 1}: a YAML alias refers to itself: "
                                 f"refusing it")
        active.add(key)
        children = (node.value if isinstance(node, yaml.SequenceNode)
                    else [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else [])
        total = 1 + sum(size(child) for child in children)
        active.discard(key)
        if total > MAX_EXPANDED_NODES:
            raise InventoryError(f"{path}: line {node.start_mark.line + 1}: the YAML expands to more than "
                                 f"{MAX_EXPANDED_NODES} nodes through its aliases: refusing it (an "
                                 "alias bomb?)")
        sizes[key] = total
        return total

    return size(root) if root is not None else 0


def load_yaml(text: str, path: str):
    loader = StrictLoader(text, path)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
