"""The ctypes mirrors against the C header: struct layouts (compiled with the
machine's C compiler), the status table and the prototypes."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

import activekv as akv
from activekv import _lib
from activekv.errors import STATUS_NAMES, error_for

from conftest import header_dir


def _compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def test_struct_layouts_match_c(tmp_path):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine: struct layouts NOT checked")
    inc = header_dir()
    assert inc is not None, "akv.h not found (neither installed nor in the checkout)"
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "akv.h"', "int main(void) {"]
    for cname, cls in _lib.STRUCTS.items():
        lines.append(f'  printf("{cname} size %zu align %zu\\n", sizeof({cname}), '
                     f'_Alignof({cname}));')
        for field, *_ in cls._fields_:
            lines.append(f'  printf("{cname}.{field} %zu\\n", offsetof({cname}, {field}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", inc, str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c_side, py_side = {}, {}
    for line in out.splitlines():
        parts = line.split()
        if parts[1] == "size":
            c_side[parts[0]] = (int(parts[2]), int(parts[4]))
        else:
            c_side[parts[0]] = int(parts[1])
    for cname, cls in _lib.STRUCTS.items():
        py_side[cname] = (ctypes.sizeof(cls), ctypes.alignment(cls))
        for field, *_ in cls._fields_:
            py_side[f"{cname}.{field}"] = getattr(cls, field).offset
    assert py_side == c_side


def _header_text():
    inc = header_dir()
    if inc is None:
        pytest.skip("akv.h not found: header comparison NOT done")
    with open(os.path.join(inc, "akv.h")) as f:
        return f.read()


def test_every_struct_of_the_header_is_mirrored():
    text = _header_text()
    declared = set(re.findall(r"typedef struct (akv_\w+) \{", text))
    assert declared == set(_lib.STRUCTS)


def test_status_table_matches_header():
    text = _header_text()
    body = re.search(r"typedef enum akv_status \{(.*?)\} akv_status;", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    header = {int(v): n for n, v in re.findall(r"(AKV_\w+)\s*=\s*(\d+)", body)
              if n != "AKV_STATUS_COUNT_"}
    assert STATUS_NAMES == header
    # and the loaded library agrees with the header on the count of statuses
    for st in header:
        assert _lib.lib.akv_status_string(st) != b"unknown status"
    assert _lib.lib.akv_status_string(max(header) + 1) == b"unknown status"


def test_every_function_of_the_header_has_a_prototype():
    text = _header_text()
    declared = set(re.findall(r"AKV_API [^;(]*?\b(akv_\w+)\s*\(", text))
    known = set(_lib._PROTOTYPES) | set(_lib._OPTIONAL)
    assert declared - known == set()


def test_every_status_has_its_class_and_unknown_ones_the_base():
    for st, name in STATUS_NAMES.items():
        if st == 0:
            continue
        err = error_for(st, "msg")
        assert isinstance(err, akv.ActiveKVError)
        assert type(err) is not akv.ActiveKVError, name
        assert type(err).c_name == name and err.status == st and err.name == name
        assert err.message == "msg" and name in str(err)
    err = error_for(999, "from a newer library")
    assert type(err) is akv.ActiveKVError
    assert err.status == 999 and err.name == "AKV_STATUS_999"


def test_version_matches_library():
    assert akv.__version__ == _lib.lib.akv_version_string().decode()
    major, minor, patch = (int(x) for x in akv.__version__.split("."))
    assert _lib.lib.akv_version_number() == major * 10000 + minor * 100 + patch
