"""A Python streaming data source whose offsets are shaped like Spark's Kafka source.

Used by the demo and the tests: the JVM Kafka source needs jars that cannot be downloaded
on every machine, and a broker is not needed to show offsets flowing. Offsets look exactly
like the Kafka source's: ``{"<topic>": {"<partition>": <next offset>}}``. The record at
(partition p, offset o) is deterministic (``value = "p<p>-o<o>"``), so a test can check that
a resumed query reads exactly the records after the saved position — no gap, no overlap.

Options: ``topic`` (default ``events``), ``partitions`` (default 2), ``rowsPerBatch`` (records
per partition per micro-batch, default 10), ``maxOffset`` (no record at or beyond this offset:
the query then goes idle; default unbounded), ``startingOffsets`` (the Kafka source's JSON;
-2 means earliest = 0; default earliest).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

SCHEMA = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("value", StringType()),
    ]
)


class _Range(InputPartition):
    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


class KafkaShapedReader(DataSourceStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        options = {k.lower(): v for k, v in options.items()}  # Spark options ignore case
        self.topic = options.get("topic", "events")
        self.partitions_n = int(options.get("partitions", "2"))
        self.rows = int(options.get("rowsperbatch", "10"))
        self.starting = options.get("startingoffsets", "earliest")
        self.max_offset = int(options["maxoffset"]) if "maxoffset" in options else None

    def initialOffset(self) -> dict[str, Any]:
        offsets = {str(p): 0 for p in range(self.partitions_n)}
        if self.starting not in ("earliest", "latest"):
            given = json.loads(self.starting).get(self.topic, {})
            for p, o in given.items():
                offsets[p] = max(0, int(o))  # -2 (earliest) and -1 (latest) start at 0 here
        return {self.topic: offsets}

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        def advance(offset: int) -> int:
            end = offset + self.rows
            return end if self.max_offset is None else max(offset, min(end, self.max_offset))

        return {self.topic: {p: advance(o) for p, o in start[self.topic].items()}}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        s, e = start[self.topic], end[self.topic]
        return [_Range(self.topic, int(p), s[p], e[p]) for p in sorted(e, key=int) if e[p] > s[p]]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, _Range)
        for offset in range(partition.start, partition.end):
            yield (
                partition.topic,
                partition.partition,
                offset,
                f"p{partition.partition}-o{offset}",
            )


class KafkaShapedSource(DataSource):
    """Register with ``spark.dataSource.register(KafkaShapedSource)``; format name below."""

    @classmethod
    def name(cls) -> str:
        return "kafka_shaped"

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaShapedReader(dict(self.options))
