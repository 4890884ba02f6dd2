"""The fused residual-add ops (add_layer_norm, add_rms_norm): through the public API, the
backends' own fused functions, the torch modules, and real transformers patched with them."""
