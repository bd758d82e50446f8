"""The ctypes mirrors against the C headers (akv.h and akv_attention.h): struct
layouts, constants and enum values (compiled with the machine's C compiler),
the status table, every enum, every prototype (name, arity, return type), and
the loaded library's exports."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

import activekv as akv
from activekv import _api, _lib
from activekv.errors import STATUS_NAMES, error_for

from conftest import header_dir

HEADERS = ("akv.h", "akv_attention.h")

# Each enum of the headers -> the package's table as {C name: value}. An enum
# added to a header must be added here.
ENUMS = {
    "akv_status": {n: v for v, n in STATUS_NAMES.items()},
    "akv_backend_kind": {f"AKV_BACKEND_{k.upper()}": v for k, v in _api.BACKENDS.items()},
    "akv_dtype": {f"AKV_DTYPE_{k.upper()}": v for k, v in _api.DTYPES.items()},
    "akv_fit_mode": {f"AKV_FIT_{k.upper()}": v for k, v in _api.FIT_MODES.items()},
    "akv_route": {f"AKV_ROUTE_{k.upper()}": v for k, v in _api.ROUTES.items()},
    "akv_log_level": {f"AKV_LOG_{k.upper()}": v for k, v in _api.LOG_LEVELS.items()},
    "akv_op_kind": {f"AKV_OP_{k.upper()}": v for k, v in _api.OP_KINDS.items()},
    "akv_adm_rule": {f"AKV_ADM_{k.upper()}": v for v, k in enumerate(_api.ADM_RULES)},
}
# Enumerators that count the others rather than name a value.
COUNTS = {"AKV_STATUS_COUNT_": len(STATUS_NAMES), "AKV_OP_KIND_COUNT": len(_api.OP_KINDS),
          "AKV_ADM_RULE_COUNT": len(_api.ADM_RULES)}


def _compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _header_text():
    inc = header_dir()
    if inc is None:
        pytest.skip("akv.h not found: header comparison NOT done")
    text = ""
    for h in HEADERS:
        path = os.path.join(inc, h)
        assert os.path.isfile(path), f"{h} missing next to akv.h in {inc}"
        with open(path) as f:
            text += f.read() + "\n"
    return text


def _strip_comments(text):
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def test_struct_layouts_constants_and_enum_values_match_c(tmp_path):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine: struct layouts NOT checked")
    inc = header_dir()
    assert inc is not None, "akv.h not found (neither installed nor in the checkout)"
    lines = ["#include <stdio.h>", "#include <stddef.h>"]
    lines += [f'#include "{h}"' for h in HEADERS]
    lines.append("int main(void) {")
    for cname, cls in _lib.STRUCTS.items():
        lines.append(f'  printf("{cname} size %zu align %zu\\n", sizeof({cname}), '
                     f'_Alignof({cname}));')
        for field, *_ in cls._fields_:
            lines.append(f'  printf("{cname}.{field} %zu\\n", offsetof({cname}, {field}));')
    values = dict(_lib.CONSTANTS)
    for table in ENUMS.values():
        values.update(table)
    values.update(COUNTS)
    for name in values:
        lines.append(f'  printf("{name} %llu\\n", (unsigned long long)({name}));')
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
    py_side.update(values)
    assert py_side == c_side


def test_every_struct_of_the_headers_is_mirrored():
    text = _header_text()
    declared = set(re.findall(r"typedef struct (akv_\w+) \{", text))
    assert declared == set(_lib.STRUCTS)


def test_every_field_of_every_struct_is_mirrored_in_order():
    """Field names in declaration order (the compiled layout test also checks the
    offsets; this one also runs without a C compiler)."""
    text = _strip_comments(_header_text())
    for cname, cls in _lib.STRUCTS.items():
        body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (cname, cname), text, re.S).group(1)
        names = []
        for decl in body.split(";"):
            decl = decl.strip()
            if not decl:
                continue
            head, *rest = decl.split(",")  # uint64_t a, b, c;
            first = re.search(r"(\w+)\s*(\[[^\]]*\])?$", head.strip()).group(1)
            names.append(first)
            names += [r.strip().lstrip("*").split("[")[0].strip() for r in rest]
        assert names == [f for f, *_ in cls._fields_], cname


def _enum_bodies(text):
    text = _strip_comments(text)
    return {name: body for body, name in
            re.findall(r"typedef enum akv_\w+ \{(.*?)\} (akv_\w+);", text, re.S)}


def test_status_table_matches_header():
    body = _enum_bodies(_header_text())["akv_status"]
    header = {int(v): n for n, v in re.findall(r"(AKV_\w+)\s*=\s*(\d+)", body)
              if n != "AKV_STATUS_COUNT_"}
    assert STATUS_NAMES == header
    assert {24: "AKV_ERR_NOT_READY", 20: "AKV_ERR_UNEVEN_LAYERS"}.items() <= header.items()
    # and the loaded library agrees with the header on the count of statuses
    for st in header:
        assert _lib.lib.akv_status_string(st) != b"unknown status"
    assert _lib.lib.akv_status_string(max(header) + 1) == b"unknown status"


def test_every_enum_of_the_headers_is_mirrored():
    bodies = _enum_bodies(_header_text())
    assert set(bodies) == set(ENUMS), "an enum of the headers has no table in ENUMS"
    for name, body in bodies.items():
        header = {n: int(v) for n, v in re.findall(r"(AKV_\w+)\s*=\s*(\d+)", body)
                  if n not in COUNTS}
        assert header == ENUMS[name], name
        for n, v in re.findall(r"(AKV_\w+)\s*=\s*(\d+)", body):
            if n in COUNTS:
                assert int(v) == COUNTS[n], n
    assert _lib.AKV_ADM_RULE_COUNT == len(_api.ADM_RULES)
    assert _lib.AKV_OP_KIND_COUNT == len(_api.OP_KINDS)


def test_rule_names_are_the_library_names():
    for i, name in enumerate(_api.ADM_RULES):
        assert _lib.lib.akv_adm_rule_string(i).decode().replace("-", "_") == name


def _prototypes(text):
    """{name: (return type text, number of parameters)} of every AKV_API function."""
    out = {}
    for ret, name, params in re.findall(r"AKV_API\s+([^;(]*?)\b(akv_\w+)\s*\(([^;]*?)\)\s*;",
                                        _strip_comments(text), re.S):
        depth, n = 0, 1
        for ch in params:
            depth += ch == "("
            depth -= ch == ")"
            n += ch == "," and depth == 0
        out[name] = (" ".join(ret.split()), 0 if params.strip() == "void" else n)
    return out


def test_every_function_of_the_headers_has_a_prototype():
    declared = _prototypes(_header_text())
    known = dict(_lib._PROTOTYPES)
    known.update(_lib._OPTIONAL)
    assert set(declared) == set(known)
    restypes = {"akv_status": _lib.c_enum, "const char *": ctypes.c_char_p,
                "unsigned": ctypes.c_uint}
    for name, (ret, nargs) in declared.items():
        res, args = known[name]
        assert len(args) == nargs, name
        assert res is restypes[ret], name


def test_the_library_exports_every_function_of_the_headers():
    """The library this package was built with has every entry point (the optional
    ones are optional only for an older library given through ACTIVEKV_LIBRARY)."""
    missing = [n for n in _prototypes(_header_text()) if not _lib.has_symbol(n)]
    assert missing == []


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


@pytest.mark.parametrize("status,cls,group", [
    (20, "UnevenLayers", "UsageError"),
    (21, "Timeout", "TransportError"),
    (22, "Comm", "TransportError"),
    (23, "Disagree", "UsageError"),
    (24, "NotReady", "UsageError"),
])
def test_new_statuses_have_their_class_in_their_group(status, cls, group):
    err = error_for(status, "msg")
    assert type(err) is getattr(akv, cls)
    assert isinstance(err, getattr(akv, group))
    assert err.name == STATUS_NAMES[status] and err.status == status
    assert getattr(akv, cls).make("again").status == status
    assert cls in akv.__all__


def test_version_matches_library():
    assert akv.__version__ == _lib.lib.akv_version_string().decode()
    major, minor, patch = (int(x) for x in akv.__version__.split("."))
    assert _lib.lib.akv_version_number() == major * 10000 + minor * 100 + patch


def test_mirrors_are_those_of_the_loaded_library():
    # The mirrors name the ABI (major.minor) whose structs they copy; the
    # library this package builds is of that ABI.
    number = _lib.lib.akv_version_number()
    assert (number // 10000, number // 100 % 100) == _lib.MIRRORED_VERSION


@pytest.mark.parametrize("number,ok", [(300, True), (305, True), (200, True), (10, True),
                                       (400, False), (10000, False), (10300, False)])
def test_a_library_newer_than_the_mirrors_is_refused(number, ok):
    # A newer library may fill larger structs than the mirrors hold (akv.h:
    # sizes are fixed within a soname only); loading it is an ImportError.
    if ok:
        _lib.check_version(number, "libactivekv.so")
    else:
        with pytest.raises(ImportError, match="newer than the 0.3"):
            _lib.check_version(number, "libactivekv.so")
