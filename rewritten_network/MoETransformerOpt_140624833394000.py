import sys
import mindspore
from mindspore import nn
from mindspore.nn import Cell
from mindspore.ops import functional as F
#
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_prim import *
from mindspore.ops.auto_generate.pyboost_inner_prim import *
from mindspore.ops.operations.manually_defined.ops_def import *
from mindspore.ops.auto_generate.gen_ops_def import zeros_op

def zeros_opt(size, dtype=None):
    zeros_op_var = zeros_op(size, dtype)
    return zeros_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import select_op

def select_opt(condition, input, other):
    select_op_var = select_op(condition, input, other)
    return select_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/function')
from mindspore.ops.function.array_func import zeros_like_
from mindspore.ops.function.array_func import cast_

def zeros_like_opt(input, *, dtype=None):
    _dtype = input.dtype if dtype is None else dtype
    output = zeros_like_(input)
    output = cast_(output, _dtype)
    return output
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/function')
from mindspore.ops.function.array_func import fillv2_

def fill_opt(type, shape, value):
    value = cast_(value, type)
    fillv2__var = fillv2_(shape, value)
    return fillv2__var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/function')
from mindspore.ops.function.math_func import logical_and_

def logical_and_opt(input, other):
    logical_and__var = logical_and_(input, other)
    return logical_and__var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import equal_op

def equal_opt(input, other):
    equal_op_var = equal_op(input, other)
    return equal_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/function')
from mindspore.ops.operations.array_ops import Tril
from mindspore.ops._primitive_cache import _get_cache_prim
from mindspore.ops.auto_generate import diagonal
from mindspore.ops.function.array_func import Tril as Tril_1

def tril_opt(input, diagonal=0):
    _get_cache_prim_var = _get_cache_prim(Tril_1)
    tril_ = _get_cache_prim_var(diagonal)
    tril__var = tril_(input)
    return tril__var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import ones_op

def ones_opt(shape, dtype=None):
    ones_op_var = ones_op(shape, dtype)
    return ones_op_var
#
sys.path.insert(0, '/work/wt/dist/model')
import mindspore as ms

def document_causal_mask(doc_ids_BS):
    seq_len = doc_ids_BS.shape[1]
    tuple_var = (seq_len, seq_len)
    ones_var = ones_opt(tuple_var, ms.bool_)
    causal_SS = tril_opt(ones_var)
    expand_dims_var_2 = doc_ids_BS.expand_dims(1)
    expand_dims_var_1 = doc_ids_BS.expand_dims(2)
    same_doc_BSS = equal_opt(expand_dims_var_1, expand_dims_var_2)
    allowed_BSS = logical_and_opt(same_doc_BSS, causal_SS)
    fill_var = fill_opt(ms.float32, allowed_BSS.shape, MASK_VALUE)
    zeros_like_var = zeros_like_opt(same_doc_BSS, dtype=ms.float32)
    mask_BSS = select_opt(allowed_BSS, zeros_like_var, fill_var)
    expand_dims_var = mask_BSS.expand_dims(1)
    return expand_dims_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import cos_op

def cos_opt(input):
    cos_op_var = cos_op(input)
    return cos_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import sin_op

def sin_opt(input):
    sin_op_var = sin_op(input)
    return sin_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')

def cat(tensors, axis=0):
    concat_impl_var = concat_impl(tensors, axis)
    return concat_impl_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/function')

def concat_opt(tensors, axis=0):
    cat_var = cat(tensors, axis)
    return cat_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/function')
from mindspore.ops import operations as P

def stack_opt(tensors, axis=0):
    _get_cache_prim_var_1 = _get_cache_prim(P.Stack)
    _stack = _get_cache_prim_var_1(axis)
    _stack_var = _stack(tensors)
    return _stack_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import pow_op

def pow_opt(input, exponent):
    pow_op_var = pow_op(input, exponent)
    return pow_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import maximum_op

def maximum_opt(input, other):
    maximum_op_var = maximum_op(input, other)
    return maximum_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import Gather

def gather_opt(input_params, input_indices, axis, batch_dims=0):
    _get_cache_prim_var = _get_cache_prim(Gather)
    gather_op = _get_cache_prim_var(batch_dims)
    gather_op_var = gather_op(input_params, input_indices, axis)
    return gather_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/auto_generate')
from mindspore.ops.auto_generate.gen_ops_def import rsqrt_op

def rsqrt_opt(input):
    rsqrt_op_var = rsqrt_op(input)
    return rsqrt_op_var
#
sys.path.insert(0, '/work/venv/lib/python3.11/site-packages/mindspore/ops/function')

def mean_opt(x, axis=None, keep_dims=False):
    compare_var = axis is None
    if compare_var:
        axis = ()
    _get_cache_prim_var = _get_cache_prim(P.ReduceMean)
    function_var_1 = _get_cache_prim_var(keep_dims)
    function_var = function_var_1(x, axis)
    return function_var
#
sys.path.insert(0, '/work/wt/dist/model')
from model.norm import RMSNorm

class RMSNormOpt(RMSNorm, nn.Cell):

    def __init__(self, obj):
        nn.Cell.__init__(self)
        for key, value in obj.__dict__.items():
            setattr(self, key, value)

    def construct(self, x):
        x_fp32 = x.astype(ms.float32)
        usub_var = -1
        mult_var_1 = x_fp32 * x_fp32
        variance = mean_opt(mult_var_1, usub_var, keep_dims=True)
        add_var = variance + self.eps
        rsqrt_var = rsqrt_opt(add_var)
        normed = x_fp32 * rsqrt_var
        mult_var = normed * self.weight
        astype_var = mult_var.astype(x.dtype)
        return astype_var
#
sys.path.insert(0, '/work/wt/dist/model')
from model.transformer import Embedding

class EmbeddingOpt(Embedding, nn.Cell):

    def __init__(self, obj):
        nn.Cell.__init__(self)
        for key, value in obj.__dict__.items():
            setattr(self, key, value)

    def construct(self, input_ids_BS):
        gather_var = gather_opt(self.weight, input_ids_BS, 0)
        return gather_var
#
sys.path.insert(0, '/work/wt/dist/model')
from model.rope import RotaryEmbedding

class RotaryEmbeddingOpt(RotaryEmbedding, nn.Cell):

    def __init__(self, obj):
        nn.Cell.__init__(self)
        for key, value in obj.__dict__.items():
            setattr(self, key, value)

    def construct(self, positions_S):
        not_var = not self.dynamic
        if not_var:
            gather_var_1 = gather_opt(self.sin_table, positions_S, 0)
            gather_var = gather_opt(self.cos_table, positions_S, 0)
            tuple_var = (gather_var, gather_var_1)
            return tuple_var
        positions_f = positions_S.astype(ms.float32)
        max_var = positions_f.max()
        add_var = max_var + 1.0
        seq_len = maximum_opt(add_var, self.original)
        sub_var = self.factor - 1.0
        mult_var = self.factor * seq_len
        div_var = mult_var / self.original
        alpha = div_var - sub_var
        usub_var = -self.ntk_exponents
        pow_var = pow_opt(alpha, usub_var)
        inv_freq = self.default_inv_freq * pow_var
        expand_dims_var_1 = inv_freq.expand_dims(0)
        expand_dims_var = positions_f.expand_dims(1)
        angles = expand_dims_var * expand_dims_var_1
        if self.interleaved:
            usub_var_1 = -1
            usub_var_2 = -1
            tuple_var_1 = (angles, angles)
            stack_var = stack_opt(tuple_var_1, usub_var_2)
            angles = stack_var.reshape(usub_var_1, self.rotary_dim)
        else:
            usub_var_3 = -1
            tuple_var_2 = (angles, angles)
            angles = concat_opt(tuple_var_2, usub_var_3)
        sin_var = sin_opt(angles)
        cos_var = cos_opt(angles)
        tuple_var = (cos_var, sin_var)
        return tuple_var
#
sys.path.insert(0, '/work/wt/dist/model')
from mindspore import nn, ops
from model.moe.layer import ROUTING_STATS, LAYER_STATS
from model.transformer import MoETransformer
from mindspore.train.amp import amp_cast

class MoETransformerOpt(MoETransformer, nn.Cell):

    def __init__(self, obj):
        nn.Cell.__init__(self)
        for key, value in obj.__dict__.items():
            setattr(self, key, value)
        self.rotary_emb = RotaryEmbeddingOpt(self.rotary_emb)
        self.embed_tokens = EmbeddingOpt(self.embed_tokens)
        self.norm = RMSNormOpt(self.norm)

    def construct(self, input_ids_BS, doc_ids_BS):
        batch, seq_len = input_ids_BS.shape
        arange_var = ops.arange(seq_len, dtype=ms.int32)
        cos, sin = self.rotary_emb(arange_var)
        mask_B1SS = document_causal_mask(doc_ids_BS)
        x_BSH = self.embed_tokens(input_ids_BS)
        aux_losses = []
        z_losses = []
        routing_stats = []
        layer_stats = []
        enumerate_var = enumerate(self.layers)
        for layer_idx, layer in enumerate_var:
            compare_var = layer_idx < self.num_dense
            if compare_var:
                x_BSH = layer(x_BSH, cos, sin, mask_B1SS)
            else:
                x_BSH, aux, router_z, layer_routing, layer_scalars = layer(x_BSH, cos, sin, mask_B1SS, doc_ids_BS)
                aux_losses.append(aux)
                z_losses.append(router_z)
                routing_stats.append(layer_routing)
                layer_stats.append(layer_scalars)
        x_BSH = self.norm(x_BSH)
        head = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        usub_var_1 = -1
        mult_var = batch * seq_len
        reshape_var = x_BSH.reshape(mult_var, usub_var_1)
        reshape_var = amp_cast(reshape_var, mindspore.float16)
        head_var = amp_cast(head, mindspore.float16)
        logits_matmul_var = self.logits_matmul(reshape_var, head_var)
        logits_matmul_var = amp_cast(logits_matmul_var, mindspore.float32)
        logits = logits_matmul_var.astype(ms.float32)
        usub_var = -1
        logits_BSV = logits.reshape(batch, seq_len, usub_var)
        not_var = not aux_losses
        if not_var:
            tuple_var_4 = ()
            zero = zeros_opt(tuple_var_4, ms.float32)
            len_var_1 = len(LAYER_STATS)
            tuple_var_3 = (0, len_var_1)
            zeros_var_1 = zeros_opt(tuple_var_3, ms.float32)
            len_var = len(ROUTING_STATS)
            tuple_var_2 = (0, len_var, self.config.num_experts)
            zeros_var = zeros_opt(tuple_var_2, ms.float32)
            tuple_var_1 = (logits_BSV, zero, zero, zeros_var, zeros_var_1)
            return tuple_var_1
        stack_var_1 = stack_opt(layer_stats)
        stack_var = stack_opt(routing_stats)
        stack_var_3 = stack_opt(z_losses)
        sum_var_1 = stack_var_3.sum()
        stack_var_2 = stack_opt(aux_losses)
        sum_var = stack_var_2.sum()
        tuple_var = (logits_BSV, sum_var, sum_var_1, stack_var, stack_var_1)
        return tuple_var
#