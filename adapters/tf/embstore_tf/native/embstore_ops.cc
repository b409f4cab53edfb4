// The TF adapter's ops that reach an embedding store without tf.numpy_function.
//
// tf.numpy_function goes through TF's PyFunc kernel and FuncRegistry (Python frames, per-array
// conversions and checks on each call) and leaves the gather, the gradient's densifying
// segment sum and the shape checks to separate graph ops. These kernels take the GIL, hand the
// tensors to a Python callable registered in embstore_tf._native as numpy views of the tensors'
// own buffers (no copy; a view keeps its tensor alive), and do the row work here:
//
//   EmbstoreRows(keys, trigger) -> rows, uniq, idx, counts: calls run(keys) -> (uniq, idx,
//     counts, vectors) (distinct keys, each key's position in them, occurrences, their rows)
//     and gathers rows[i] = vectors[idx[i]] (idx == len(uniq): a padding position, a zero row).
//   EmbstoreApply(uniq, idx, counts, dy) -> done: sums dy per distinct key in input order (as
//     TF's UnsortedSegmentSum does, so the sums are bit for bit the same) and calls
//     apply(uniq, sums, counts).
//   EmbstorePyCall(args) -> outs: calls fn(*args) and copies what it returns (sampling).
//
// Built by embstore_tf._native against the installed TensorFlow, Python and numpy headers;
// Python's symbols resolve from the process that loads it (no link against libpython).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL embstore_tf_ARRAY_API
#include <numpy/arrayobject.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

using tensorflow::DataType;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("EmbstorePyCall")
    .Input("args: Tin")
    .Output("outs: Tout")
    .Attr("handle: int")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnknownShape);

// ``trigger`` only carries the gradient (embstore_tf's trigger variable); its gradient
// function (registered from Python) adds the EmbstoreApply of ``apply_handle``.
REGISTER_OP("EmbstoreRows")
    .Input("keys: Tkey")
    .Input("trigger: Ttrigger")
    .Output("rows: float")
    .Output("uniq: Tkey")
    .Output("idx: int64")
    .Output("counts: int64")
    .Attr("handle: int")
    .Attr("apply_handle: int")
    .Attr("dim: int >= 0")
    .Attr("Tkey: {int64, string}")
    .Attr("Ttrigger: type")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle keys;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &keys));
      int64_t dim = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(0, c->MakeShape({c->Dim(keys, 0), dim}));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(2, c->Vector(c->Dim(keys, 0)));
      c->set_output(3, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    });

REGISTER_OP("EmbstoreApply")
    .Input("uniq: Tkey")
    .Input("idx: int64")
    .Input("counts: int64")
    .Input("dy: float")
    .Output("done: int64")
    .Attr("handle: int")
    .Attr("Tkey: {int64, string}")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

namespace {

constexpr const char* kRegistry = "embstore_tf._native";
constexpr const char* kCapsule = "embstore_tf.tensor";

class Gil {
 public:
  Gil() {
    // A TF thread Python has not seen gets a thread state once and keeps it (released, not
    // deleted): PyGILState_Ensure would otherwise create and destroy one on every call.
    thread_local bool kept = false;
    if (!kept && PyGILState_GetThisThreadState() == nullptr) {
      PyGILState_Ensure();
      PyEval_SaveThread();
    }
    kept = true;
    state_ = PyGILState_Ensure();
  }
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// Runs fn() with the GIL held, its status the op's; an op still running once the interpreter
// is gone (a graph executing at exit) fails instead.
template <typename Fn>
void RunInPython(OpKernelContext* ctx, const char* op, Fn&& fn) {
  OP_REQUIRES(ctx, Py_IsInitialized(),
              absl::FailedPreconditionError(std::string(op) + ": Python is not running"));
  Gil gil;
  OP_REQUIRES_OK(ctx, fn());
}

class Ref {  // an owned PyObject*, released on scope exit (with the GIL held)
 public:
  explicit Ref(PyObject* o = nullptr) : o_(o) {}
  ~Ref() { Py_XDECREF(o_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return o_; }
  PyArrayObject* array() const { return reinterpret_cast<PyArrayObject*>(o_); }
  void reset(PyObject* o) {
    Py_XDECREF(o_);
    o_ = o;
  }

 private:
  PyObject* o_;
};

PyObject* g_calls = nullptr;  // embstore_tf._native.CALLS: handle -> callable (owned)

int NumpyType(DataType dt) {
  switch (dt) {
    case tensorflow::DT_FLOAT: return NPY_FLOAT32;
    case tensorflow::DT_DOUBLE: return NPY_FLOAT64;
    case tensorflow::DT_HALF: return NPY_FLOAT16;
    case tensorflow::DT_INT64: return NPY_INT64;
    case tensorflow::DT_INT32: return NPY_INT32;
    case tensorflow::DT_INT16: return NPY_INT16;
    case tensorflow::DT_INT8: return NPY_INT8;
    case tensorflow::DT_UINT8: return NPY_UINT8;
    case tensorflow::DT_UINT16: return NPY_UINT16;
    case tensorflow::DT_UINT32: return NPY_UINT32;
    case tensorflow::DT_UINT64: return NPY_UINT64;
    case tensorflow::DT_BOOL: return NPY_BOOL;
    case tensorflow::DT_STRING: return NPY_OBJECT;
    default: return -1;
  }
}

// The pending Python exception as a TF status, with the codes PyFunc gives the same exceptions
// (ValueError/TypeError: InvalidArgument, ...) and the traceback in the message.
absl::Status PythonError(const std::string& what) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  Ref t(type), v(value), trace(tb);
  std::string msg = what + ": ";
  if (t.get() == nullptr) {
    msg += "(no Python exception set)";
  } else {
    Ref mod(PyImport_ImportModule("traceback"));
    Ref lines(mod.get() ? PyObject_CallMethod(mod.get(), "format_exception", "OOO", t.get(),
                                              v.get() ? v.get() : Py_None,
                                              trace.get() ? trace.get() : Py_None)
                        : nullptr);
    Ref sep(PyUnicode_FromString(""));
    Ref text(lines.get() && sep.get() ? PyUnicode_Join(sep.get(), lines.get()) : nullptr);
    const char* s = text.get() ? PyUnicode_AsUTF8(text.get()) : nullptr;
    if (s != nullptr) {
      msg += s;
    } else {
      PyErr_Clear();
      Ref str(v.get() ? PyObject_Str(v.get()) : nullptr);
      s = str.get() ? PyUnicode_AsUTF8(str.get()) : nullptr;
      msg += s ? s : "(unprintable Python exception)";
      PyErr_Clear();
    }
  }
  PyObject* e = t.get();
  auto is = [e](PyObject* cls) { return e != nullptr && PyErr_GivenExceptionMatches(e, cls); };
  if (is(PyExc_ValueError) || is(PyExc_TypeError)) return absl::InvalidArgumentError(msg);
  if (is(PyExc_StopIteration) || is(PyExc_IndexError)) return absl::OutOfRangeError(msg);
  if (is(PyExc_MemoryError)) return absl::ResourceExhaustedError(msg);
  if (is(PyExc_NotImplementedError)) return absl::UnimplementedError(msg);
  return absl::UnknownError(msg);
}

absl::Status Init() {  // under the GIL
  if (g_calls != nullptr) return absl::OkStatus();
  if (PyArray_API == nullptr && _import_array() < 0) return PythonError("importing numpy");
  Ref mod(PyImport_ImportModule(kRegistry));
  if (mod.get() == nullptr) return PythonError("importing embstore_tf._native");
  PyObject* calls = PyObject_GetAttrString(mod.get(), "CALLS");
  if (calls == nullptr) return PythonError("embstore_tf._native.CALLS");
  if (!PyDict_Check(calls)) {
    Py_DECREF(calls);
    return absl::InternalError("embstore_tf._native.CALLS is not a dict");
  }
  g_calls = calls;
  return absl::OkStatus();
}

// The callable registered under ``handle`` (a new reference: the registry may drop it while
// it runs), or an error.
absl::Status Lookup(int64_t handle, Ref* fn) {
  TF_RETURN_IF_ERROR(Init());
  Ref key(PyLong_FromLongLong(handle));
  if (key.get() == nullptr) return PythonError("embstore op");
  PyObject* found = PyDict_GetItemWithError(g_calls, key.get());  // borrowed
  if (found != nullptr) {
    Py_INCREF(found);
    fn->reset(found);
    return absl::OkStatus();
  }
  if (PyErr_Occurred()) return PythonError("embstore op");
  return absl::FailedPreconditionError(
      "embstore op: no Python function under handle " + std::to_string(handle) +
      ": this graph outlived the Python process or graph that traced it (a SavedModel of a "
      "training graph); serve with embstore_tf.serving_model / export_serving instead");
}

void FreeTensor(PyObject* capsule) {
  delete static_cast<Tensor*>(PyCapsule_GetPointer(capsule, kCapsule));
}

// A numpy view of ``t`` sharing its buffer (writeable only when asked: a private tensor), or
// an object array of bytes for a string tensor. New reference, or nullptr with an exception.
PyObject* ToNumpy(const Tensor& t, bool writeable = false) {
  const int nd = t.dims();
  std::vector<npy_intp> dims(nd);
  for (int i = 0; i < nd; ++i) dims[i] = t.dim_size(i);
  const int64_t n = t.NumElements();
  if (t.dtype() == tensorflow::DT_STRING) {
    PyObject* arr = PyArray_SimpleNew(nd, dims.data(), NPY_OBJECT);  // slots start as NULL
    if (arr == nullptr) return nullptr;
    auto items = static_cast<PyObject**>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(arr)));
    auto flat = t.flat<tensorflow::tstring>();
    for (int64_t i = 0; i < n; ++i) {
      items[i] = PyBytes_FromStringAndSize(flat(i).data(), flat(i).size());
      if (items[i] == nullptr) {
        Py_DECREF(arr);
        return nullptr;
      }
    }
    return arr;
  }
  const int type = NumpyType(t.dtype());
  if (n == 0) return PyArray_SimpleNew(nd, dims.data(), type);
  const int flags =
      NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | (writeable ? NPY_ARRAY_WRITEABLE : 0);
  PyObject* arr = PyArray_New(&PyArray_Type, nd, dims.data(), type, nullptr,
                              const_cast<char*>(t.tensor_data().data()), 0, flags, nullptr);
  if (arr == nullptr) return nullptr;
  PyObject* keep = PyCapsule_New(new Tensor(t), kCapsule, FreeTensor);
  if (keep == nullptr || PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(arr), keep) < 0) {
    Py_DECREF(arr);
    return nullptr;
  }
  return arr;
}

// ``value`` as a C-contiguous array of ``dt``'s numpy type (new reference), or an error.
absl::Status AsArray(PyObject* value, DataType dt, const char* what, Ref* out) {
  out->reset(PyArray_FromAny(value, PyArray_DescrFromType(NumpyType(dt)), 0, 0,
                             NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, nullptr));
  if (out->get() == nullptr) return PythonError(std::string("embstore op: ") + what);
  return absl::OkStatus();
}

// Copy the array ``a`` (of ``dt``'s numpy type) into output ``i``.
absl::Status CopyOut(OpKernelContext* ctx, int i, DataType dt, PyArrayObject* a) {
  TensorShape shape;
  for (int d = 0; d < PyArray_NDIM(a); ++d) {
    TF_RETURN_IF_ERROR(shape.AddDimWithStatus(PyArray_DIM(a, d)));
  }
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(i, shape, &out));
  const int64_t n = out->NumElements();
  if (dt != tensorflow::DT_STRING) {
    if (n > 0) {
      std::memcpy(const_cast<char*>(out->tensor_data().data()), PyArray_DATA(a),
                  PyArray_NBYTES(a));
    }
    return absl::OkStatus();
  }
  auto items = static_cast<PyObject**>(PyArray_DATA(a));
  auto flat = out->flat<tensorflow::tstring>();
  for (int64_t j = 0; j < n; ++j) {
    PyObject* o = items[j];
    char* data = nullptr;
    Py_ssize_t len = 0;
    if (o != nullptr && PyBytes_Check(o)) {
      if (PyBytes_AsStringAndSize(o, &data, &len) < 0) return PythonError("embstore op");
    } else if (o != nullptr && PyUnicode_Check(o)) {
      const char* s = PyUnicode_AsUTF8AndSize(o, &len);
      if (s == nullptr) return PythonError("embstore op");
      data = const_cast<char*>(s);
    } else {
      return absl::InvalidArgumentError("embstore op: a string result holds a non-bytes item");
    }
    flat(j).assign(data, len);
  }
  return absl::OkStatus();
}

struct Arg {
  const Tensor* tensor;
  bool writeable;  // only for a tensor this kernel made
};

// Call ``fn`` with numpy views of ``args``; ``*res`` gets its result as a sequence of exactly
// ``n_out`` items.
absl::Status Call(PyObject* fn, const std::vector<Arg>& args, size_t n_out, Ref* res) {
  Ref tuple(PyTuple_New(static_cast<Py_ssize_t>(args.size())));
  if (tuple.get() == nullptr) return PythonError("embstore op");
  Py_ssize_t i = 0;
  for (const Arg& a : args) {
    PyObject* arr = ToNumpy(*a.tensor, a.writeable);
    if (arr == nullptr) return PythonError("embstore op: an input");
    PyTuple_SET_ITEM(tuple.get(), i++, arr);  // steals
  }
  Ref out(PyObject_Call(fn, tuple.get(), nullptr));
  tuple.reset(nullptr);
  if (out.get() == nullptr) return PythonError("embstore op");
  res->reset(PySequence_Fast(out.get(), "embstore op: the function must return a sequence"));
  if (res->get() == nullptr) return PythonError("embstore op");
  const Py_ssize_t got = PySequence_Fast_GET_SIZE(res->get());
  if (got != static_cast<Py_ssize_t>(n_out)) {
    return absl::InvalidArgumentError("embstore op: the function returned " +
                                      std::to_string(got) + " values, " +
                                      std::to_string(n_out) + " expected");
  }
  return absl::OkStatus();
}

PyObject* Item(const Ref& seq, int i) { return PySequence_Fast_GET_ITEM(seq.get(), i); }

class PyCallOp : public OpKernel {
 public:
  explicit PyCallOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("handle", &handle_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tin", &tin_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tout", &tout_));
    for (const auto* types : {&tin_, &tout_}) {
      for (DataType dt : *types) {
        OP_REQUIRES(ctx, NumpyType(dt) >= 0,
                    absl::InvalidArgumentError("EmbstorePyCall: unsupported type " +
                                               tensorflow::DataTypeString(dt)));
      }
    }
  }

  void Compute(OpKernelContext* ctx) override {
    RunInPython(ctx, "EmbstorePyCall", [&] { return Run(ctx); });
  }

 private:
  absl::Status Run(OpKernelContext* ctx) {
    Ref fn;
    TF_RETURN_IF_ERROR(Lookup(handle_, &fn));
    std::vector<Arg> args;
    for (int i = 0; i < ctx->num_inputs(); ++i) args.push_back({&ctx->input(i), false});
    Ref res;
    TF_RETURN_IF_ERROR(Call(fn.get(), args, tout_.size(), &res));
    for (size_t i = 0; i < tout_.size(); ++i) {
      Ref arr;
      TF_RETURN_IF_ERROR(AsArray(Item(res, i), tout_[i], "a result", &arr));
      TF_RETURN_IF_ERROR(CopyOut(ctx, i, tout_[i], arr.array()));
    }
    return absl::OkStatus();
  }

  int64_t handle_ = 0;
  tensorflow::DataTypeVector tin_, tout_;
};

class RowsOp : public OpKernel {
 public:
  explicit RowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("handle", &handle_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tkey", &tkey_));
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES(ctx, ctx->input(0).dims() == 1,
                absl::InvalidArgumentError("EmbstoreRows: keys must be a vector"));
    RunInPython(ctx, "EmbstoreRows", [&] { return Run(ctx); });
  }

 private:
  absl::Status Run(OpKernelContext* ctx) {
    Ref fn;
    TF_RETURN_IF_ERROR(Lookup(handle_, &fn));
    const int64_t n = ctx->input(0).dim_size(0);
    Ref res;
    TF_RETURN_IF_ERROR(Call(fn.get(), {{&ctx->input(0), false}}, 4, &res));
    Ref uniq, idx, counts, vectors;
    TF_RETURN_IF_ERROR(AsArray(Item(res, 0), tkey_, "distinct keys", &uniq));
    TF_RETURN_IF_ERROR(AsArray(Item(res, 1), tensorflow::DT_INT64, "key positions", &idx));
    TF_RETURN_IF_ERROR(AsArray(Item(res, 2), tensorflow::DT_INT64, "key counts", &counts));
    TF_RETURN_IF_ERROR(AsArray(Item(res, 3), tensorflow::DT_FLOAT, "vectors", &vectors));
    const int64_t n_uniq = PyArray_SIZE(uniq.array());
    if (PyArray_NDIM(uniq.array()) != 1 || PyArray_NDIM(idx.array()) != 1 ||
        PyArray_DIM(idx.array(), 0) != n || PyArray_NDIM(vectors.array()) != 2 ||
        PyArray_DIM(vectors.array(), 0) != n_uniq || PyArray_DIM(vectors.array(), 1) != dim_) {
      return absl::InvalidArgumentError("EmbstoreRows: the lookup returned arrays of the "
                                        "wrong shapes");
    }
    TF_RETURN_IF_ERROR(CopyOut(ctx, 1, tkey_, uniq.array()));
    TF_RETURN_IF_ERROR(CopyOut(ctx, 2, tensorflow::DT_INT64, idx.array()));
    TF_RETURN_IF_ERROR(CopyOut(ctx, 3, tensorflow::DT_INT64, counts.array()));
    Tensor* rows = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({n, dim_}), &rows));
    const auto* pos = static_cast<const int64_t*>(PyArray_DATA(idx.array()));
    const auto* src = static_cast<const float*>(PyArray_DATA(vectors.array()));
    float* dst = rows->flat<float>().data();
    bool in_range = true;
    Py_BEGIN_ALLOW_THREADS;  // the arrays stay alive: this frame holds them
    const size_t row_bytes = sizeof(float) * dim_;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = pos[i];
      if (j >= 0 && j < n_uniq) {
        std::memcpy(dst + i * dim_, src + j * dim_, row_bytes);
      } else {
        std::memset(dst + i * dim_, 0, row_bytes);  // a padding position reads zeros
        in_range = in_range && j == n_uniq;
      }
    }
    Py_END_ALLOW_THREADS;
    if (!in_range) return absl::InvalidArgumentError("EmbstoreRows: a key position out of range");
    return absl::OkStatus();
  }

  int64_t handle_ = 0;
  int64_t dim_ = 0;
  DataType tkey_;
};

// o += d, element by element: vectorized across the row, each element's additions stay in
// input order.
inline void AddRow(float* __restrict o, const float* __restrict d, int64_t dim) {
  for (int64_t c = 0; c < dim; ++c) o[c] += d[c];
}

class ApplyOp : public OpKernel {
 public:
  explicit ApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("handle", &handle_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& uniq = ctx->input(0);
    const Tensor& idx = ctx->input(1);
    const Tensor& dy = ctx->input(3);
    OP_REQUIRES(ctx, uniq.dims() == 1 && idx.dims() == 1 && dy.dims() == 2 &&
                         dy.dim_size(0) == idx.dim_size(0),
                absl::InvalidArgumentError("EmbstoreApply: inputs of mismatched shapes"));
    const int64_t n = idx.dim_size(0), n_uniq = uniq.dim_size(0), dim = dy.dim_size(1);
    // The per-key sums, in input order: the sequence of additions TF's UnsortedSegmentSum
    // makes for each output row, so the store sees the same bits as on the tf.gather path.
    Tensor sums;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({n_uniq, dim}),
                                           &sums));
    float* out = sums.flat<float>().data();
    std::fill(out, out + n_uniq * dim, 0.0f);
    const int64_t* pos = idx.flat<int64_t>().data();
    const float* g = dy.flat<float>().data();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = pos[i];
      if (j == n_uniq) continue;  // a padding position: no key, no gradient
      OP_REQUIRES(ctx, j >= 0 && j < n_uniq,
                  absl::InvalidArgumentError("EmbstoreApply: a key position out of range"));
      AddRow(out + j * dim, g + i * dim, dim);
    }
    Tensor* done = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &done));
    done->scalar<int64_t>()() = n_uniq;
    RunInPython(ctx, "EmbstoreApply", [&] { return Run(ctx, sums); });
  }

 private:
  absl::Status Run(OpKernelContext* ctx, const Tensor& sums) {
    Ref fn;
    TF_RETURN_IF_ERROR(Lookup(handle_, &fn));
    Ref res;
    return Call(fn.get(), {{&ctx->input(0), false}, {&sums, true}, {&ctx->input(2), false}}, 0,
                &res);
  }

  int64_t handle_ = 0;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("EmbstorePyCall").Device(tensorflow::DEVICE_CPU), PyCallOp);
REGISTER_KERNEL_BUILDER(Name("EmbstoreRows").Device(tensorflow::DEVICE_CPU), RowsOp);
REGISTER_KERNEL_BUILDER(Name("EmbstoreApply").Device(tensorflow::DEVICE_CPU), ApplyOp);
