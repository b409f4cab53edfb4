/* Where a bytes key object's short key lies, from its address alone: the loops over batches
   of scattered key objects fetch it ahead, before they have read the object's header. */
#ifndef ES_KEYOBJ_H
#define ES_KEYOBJ_H
#include <Python.h>
#include <stddef.h>
/* The byte after the first 15 bytes of the key: with the header's line, the line holding it
   holds every byte of a key of up to 15 bytes (and its NUL) whatever the object's alignment;
   longer keys fetch their end once their length is read. */
#define ES_BYTES_SHORT_END(o) ((const char*)(o) + offsetof(PyBytesObject, ob_sval) + 15)
#endif
