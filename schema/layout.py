"""Field layouts and enum values of schema/pmx.fbs, for the runtime's reader.

Written by tools/regen_schema.py from schema/pmx_generated.py (schema/derive_layout.py);
do not edit. A table field is (vtable slot, struct code, default, stored inline)."""


class DType:
    Float32 = 0
    Float64 = 1
    Float16 = 2
    Int8 = 3
    UInt8 = 4
    Int16 = 5
    Int32 = 6
    Int64 = 7
    Bool = 8
    Complex64 = 9
    Complex128 = 10


class TensorKind:
    Intermediate = 0
    Constant = 1
    Input = 2
    Output = 3


class AttrKind:
    None_ = 0
    Bool = 1
    Int = 2
    Float = 3
    String = 4
    Ints = 5
    Floats = 6
    Strings = 7


TABLES = {
    "Attr": {
        "Name": (4, None, None, False),
        "Kind": (6, "b", 0, True),
        "IntsAsNumpy": (8, "q", 0, False),
        "IntsLength": (8, None, 0, False),
        "IntsIsNone": (8, None, True, False),
        "FloatsAsNumpy": (10, "d", 0, False),
        "FloatsLength": (10, None, 0, False),
        "FloatsIsNone": (10, None, True, False),
        "StringsLength": (12, None, 0, False),
        "StringsIsNone": (12, None, True, False),
    },
    "Tensors": {
        "Names": (4, None, None, False),
        "NameEndsAsNumpy": (6, "I", 0, False),
        "NameEndsLength": (6, None, 0, False),
        "NameEndsIsNone": (6, None, True, False),
        "KindsAsNumpy": (8, "b", 0, False),
        "KindsLength": (8, None, 0, False),
        "KindsIsNone": (8, None, True, False),
        "DtypesAsNumpy": (10, "b", 0, False),
        "DtypesLength": (10, None, 0, False),
        "DtypesIsNone": (10, None, True, False),
        "RanksAsNumpy": (12, "B", 0, False),
        "RanksLength": (12, None, 0, False),
        "RanksIsNone": (12, None, True, False),
        "DimsAsNumpy": (14, "q", 0, False),
        "DimsLength": (14, None, 0, False),
        "DimsIsNone": (14, None, True, False),
        "DataOffsetsAsNumpy": (16, "Q", 0, False),
        "DataOffsetsLength": (16, None, 0, False),
        "DataOffsetsIsNone": (16, None, True, False),
        "DataSizesAsNumpy": (18, "Q", 0, False),
        "DataSizesLength": (18, None, 0, False),
        "DataSizesIsNone": (18, None, True, False),
        "ArenaOffsetsAsNumpy": (20, "Q", 0, False),
        "ArenaOffsetsLength": (20, None, 0, False),
        "ArenaOffsetsIsNone": (20, None, True, False),
        "AliasOfAsNumpy": (22, "i", 0, False),
        "AliasOfLength": (22, None, 0, False),
        "AliasOfIsNone": (22, None, True, False),
        "AliasOffsetsAsNumpy": (24, "Q", 0, False),
        "AliasOffsetsLength": (24, None, 0, False),
        "AliasOffsetsIsNone": (24, None, True, False),
        "StridedAsNumpy": (26, "I", 0, False),
        "StridedLength": (26, None, 0, False),
        "StridedIsNone": (26, None, True, False),
        "StridesAsNumpy": (28, "q", 0, False),
        "StridesLength": (28, None, 0, False),
        "StridesIsNone": (28, None, True, False),
        "RangedAsNumpy": (30, "I", 0, False),
        "RangedLength": (30, None, 0, False),
        "RangedIsNone": (30, None, True, False),
        "DimMinAsNumpy": (32, "q", 0, False),
        "DimMinLength": (32, None, 0, False),
        "DimMinIsNone": (32, None, True, False),
        "DimMaxAsNumpy": (34, "q", 0, False),
        "DimMaxLength": (34, None, 0, False),
        "DimMaxIsNone": (34, None, True, False),
    },
    "Nodes": {
        "OpsAsNumpy": (4, "I", 0, False),
        "OpsLength": (4, None, 0, False),
        "OpsIsNone": (4, None, True, False),
        "Names": (6, None, None, False),
        "NameEndsAsNumpy": (8, "I", 0, False),
        "NameEndsLength": (8, None, 0, False),
        "NameEndsIsNone": (8, None, True, False),
        "InputEndsAsNumpy": (10, "I", 0, False),
        "InputEndsLength": (10, None, 0, False),
        "InputEndsIsNone": (10, None, True, False),
        "InputsAsNumpy": (12, "i", 0, False),
        "InputsLength": (12, None, 0, False),
        "InputsIsNone": (12, None, True, False),
        "OutputEndsAsNumpy": (14, "I", 0, False),
        "OutputEndsLength": (14, None, 0, False),
        "OutputEndsIsNone": (14, None, True, False),
        "OutputsAsNumpy": (16, "i", 0, False),
        "OutputsLength": (16, None, 0, False),
        "OutputsIsNone": (16, None, True, False),
        "AttrSetsAsNumpy": (18, "I", 0, False),
        "AttrSetsLength": (18, None, 0, False),
        "AttrSetsIsNone": (18, None, True, False),
        "ExprsAsNumpy": (20, "I", 0, False),
        "ExprsLength": (20, None, 0, False),
        "ExprsIsNone": (20, None, True, False),
        "VariantsAsNumpy": (22, "I", 0, False),
        "VariantsLength": (22, None, 0, False),
        "VariantsIsNone": (22, None, True, False),
    },
    "AttrSet": {
        "AttrsLength": (4, None, 0, False),
        "AttrsIsNone": (4, None, True, False),
    },
    "KeyValue": {
        "Key": (4, None, None, False),
        "Value": (6, None, None, False),
    },
    "PassStat": {
        "Name": (4, None, None, False),
        "NodesBefore": (6, "i", 0, True),
        "NodesAfter": (8, "i", 0, True),
    },
    "Model": {
        "Producer": (4, None, None, False),
        "Tensors": (6, None, None, False),
        "Nodes": (8, None, None, False),
        "StringsLength": (10, None, 0, False),
        "StringsIsNone": (10, None, True, False),
        "AttrSetsLength": (12, None, 0, False),
        "AttrSetsIsNone": (12, None, True, False),
        "InputsAsNumpy": (14, "i", 0, False),
        "InputsLength": (14, None, 0, False),
        "InputsIsNone": (14, None, True, False),
        "OutputsAsNumpy": (16, "i", 0, False),
        "OutputsLength": (16, None, 0, False),
        "OutputsIsNone": (16, None, True, False),
        "KeptAsNumpy": (18, "i", 0, False),
        "KeptLength": (18, None, 0, False),
        "KeptIsNone": (18, None, True, False),
        "ArenaSize": (20, "Q", 0, True),
        "PassStatsLength": (22, None, 0, False),
        "PassStatsIsNone": (22, None, True, False),
        "Source": (24, None, None, False),
        "MetadataLength": (26, None, 0, False),
        "MetadataIsNone": (26, None, True, False),
    },
}
